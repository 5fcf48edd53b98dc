"""The Python examples of README.md and docs/PYTHON.md, run as written
against a real kvdepotd on its default socket (XDG_RUNTIME_DIR points at a
private temporary directory), their output compared with the documented
output, and then `kvcachectl verify` on every pool they made: 0 NaN, 0 Inf,
0 bad scales.

A runnable block is a ```python fence with `<!-- test: python -->` on the
line above (`<!-- test: python numpy -->`: skipped without NumPy;
`<!-- test: python torch -->`: skipped without PyTorch); the
fence after it marked `<!-- test: output -->` is what it prints.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from typing import List, NamedTuple, Optional

DOCS = ["README.md", "docs/PYTHON.md"]  # paths in the runfiles root
_MARK = re.compile(r"^<!-- test: (python(?: numpy| torch)?|output) -->$")

try:
    import numpy  # noqa: F401
    HAVE_NUMPY = True
except ImportError:
    HAVE_NUMPY = False

try:
    import torch  # noqa: F401
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


class Example(NamedTuple):
    doc: str
    line: int
    code: str
    output: Optional[str]
    needs_numpy: bool
    needs_torch: bool = False


def _fence(lines: List[str], i: int, doc: str) -> str:
    """The body of the fence opening at lines[i]."""
    if not lines[i].startswith("```"):
        raise AssertionError(f"{doc}:{i + 1}: a test mark must be followed "
                             f"by a fence, not {lines[i]!r}")
    end = lines.index("```", i + 1)
    return "".join(line + "\n" for line in lines[i + 1:end])


def examples(doc: str) -> List[Example]:
    with open(doc, encoding="utf-8") as f:
        lines = f.read().splitlines()
    found: List[Example] = []
    for i, line in enumerate(lines):
        m = _MARK.match(line)
        if not m:
            continue
        if m.group(1) == "output":
            if not found or found[-1].output is not None:
                raise AssertionError(f"{doc}:{i + 1}: output without code")
            found[-1] = found[-1]._replace(output=_fence(lines, i + 1, doc))
        else:
            found.append(Example(doc, i + 2, _fence(lines, i + 1, doc), None,
                                 m.group(1).endswith("numpy"),
                                 m.group(1).endswith("torch")))
    return found


class DefaultSocketDaemon:
    """kvdepotd without --listen, XDG_RUNTIME_DIR a private directory: the
    daemon and `kvdepot.connect()` meet on the default socket."""

    def __init__(self) -> None:
        self.runtime_dir = tempfile.mkdtemp(prefix="kvdocs")
        self.env = dict(os.environ, XDG_RUNTIME_DIR=self.runtime_dir)
        self.env.pop("KVDEPOT_ADDR", None)
        self.socket = os.path.join(self.runtime_dir, "kvdepot",
                                   "kvdepotd.sock")
        self.log = open(os.path.join(self.runtime_dir, "log"), "wb")
        self.proc = subprocess.Popen([os.environ["KVDEPOT_BIN"]],
                                     env=self.env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while self.ctl("status").returncode != 0:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError("kvdepotd did not start:\n" +
                                     self.log_text())
            time.sleep(0.05)

    def ctl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([os.environ["KVCACHECTL_BIN"], *args],
                              env=self.env, capture_output=True, text=True,
                              timeout=120)

    def log_text(self) -> str:
        with open(os.path.join(self.runtime_dir, "log"), "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=60)
        self.log.close()
        return rc


class DocsExamplesTest(unittest.TestCase):

    def test_docs_have_runnable_examples(self):
        for doc in DOCS:
            self.assertTrue(examples(doc), f"{doc} marks no runnable example")

    def test_examples_run_as_documented_and_store_finite_values(self):
        for doc in DOCS:
            for ex in examples(doc):
                with self.subTest(doc=doc, line=ex.line):
                    if ex.needs_numpy and not HAVE_NUMPY:
                        self.skipTest("NumPy is not installed")
                    if ex.needs_torch and not HAVE_TORCH:
                        self.skipTest("PyTorch is not installed")
                    self._run(ex)

    def _run(self, ex: Example) -> None:
        daemon = DefaultSocketDaemon()  # one per example: names may repeat
        try:
            p = subprocess.run([sys.executable, "-c", ex.code],
                               env=daemon.env, capture_output=True,
                               text=True, timeout=300)
            self.assertEqual(p.returncode, 0,
                             f"{ex.doc}:{ex.line} failed:\n{p.stderr}")
            if ex.output is not None:
                self.assertEqual(p.stdout, ex.output,
                                 f"{ex.doc}:{ex.line} printed otherwise")
            listed = daemon.ctl("pool", "list", "-o", "json")
            self.assertEqual(listed.returncode, 0, listed.stderr)
            data = json.loads(listed.stdout)
            pools = [p["name"] for p in
                     (data["pools"] if isinstance(data, dict) else data)]
            self.assertTrue(pools, f"{ex.doc}:{ex.line} made no pool")
            for pool in pools:
                v = daemon.ctl("verify", pool, "-o", "json")
                report = json.loads(v.stdout)
                self.assertEqual(
                    (report["nan_values"], report["inf_values"],
                     report["bad_scales"], v.returncode), (0, 0, 0, 0),
                    f"{ex.doc}:{ex.line}: verify {pool}: {v.stdout}")
                self.assertGreater(report["blocks_total"], 0)
        finally:
            rc = daemon.stop()
        self.assertEqual(rc, 0, daemon.log_text())


if __name__ == "__main__":
    unittest.main()
