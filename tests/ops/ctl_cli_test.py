"""kvcachectl's face (issue 11 items 1, 4, 6): --help of every command
lists its flags, --version / version, usage errors exit 2 before any
connection (even with no daemon), KVDEPOT_ADDR with --addr > env >
default, and verify has no default deadline (a throttled scan that takes
longer than the unary 5 s default still finishes).

Usage (Bazel passes these): ctl_cli_test.py KVDEPOTD KVCACHECTL
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

KVDEPOTD, KVCACHECTL = (os.path.abspath(p) for p in sys.argv[1:3])

COMMANDS = (["status"], ["pool", "list"], ["pool", "get"], ["pool", "create"],
            ["pool", "delete"], ["stats"], ["plan"], ["inspect"], ["verify"],
            ["drain"])


def ctl(*args, env=None, timeout=60):
    e = dict(os.environ)
    e.pop("KVDEPOT_ADDR", None)
    e.update(env or {})
    p = subprocess.run([KVCACHECTL, *args], capture_output=True, text=True,
                       timeout=timeout, env=e)
    return p.returncode, p.stdout, p.stderr


class Daemon:
    def __init__(self, *flags):
        self.dir = tempfile.mkdtemp(prefix="kvctl", dir="/tmp")
        self.sock = os.path.join(self.dir, "d.sock")
        self.err = open(os.path.join(self.dir, "stderr"), "w")
        self.proc = subprocess.Popen(
            [KVDEPOTD, "--listen=" + self.sock, "--backend=cpu",
             "--drain_grace_ms=0", *flags], stderr=self.err)
        deadline = time.time() + 60
        while ctl("status", "--addr", self.sock, "--timeout", "2s")[0] != 0:
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError("kvdepotd did not start")
            time.sleep(0.05)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        self.err.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class HelpTest(unittest.TestCase):
    def test_every_command_help_lists_its_flags(self):
        for cmd in COMMANDS:
            rc, out, err = ctl(*cmd, "--help")
            self.assertEqual(rc, 0, (cmd, err))
            self.assertIn("Usage: kvcachectl " + cmd[0], out)
            for flag in ("--addr", "-o, --output", "--timeout", "--help"):
                self.assertIn(flag, out, cmd)
        rc, out, _ = ctl("pool", "create", "--help")
        for flag in ("--format", "--elements", "--block_size", "--num_blocks",
                     "--num_layers", "--device"):
            self.assertIn(flag, out)
        rc, out, _ = ctl("--help")
        self.assertEqual(rc, 0)
        self.assertIn("KVDEPOT_ADDR", out)
        self.assertIn("version", out)

    def test_version(self):
        for args in (["--version"], ["version"]):
            rc, out, _ = ctl(*args)
            self.assertEqual(rc, 0)
            self.assertRegex(out, r"^kvcachectl \d+\.\d+\.\d+\n$")
        self.assertEqual(ctl("version", "extra")[0], 2)


class NoDaemonTest(unittest.TestCase):
    """Nothing listens at the address: usage errors still exit 2, fast."""

    def test_usage_errors_exit_2_before_connecting(self):
        addr = ["--addr", "/tmp/kvctl-nobody-%d.sock" % os.getpid()]
        cases = [
            ["status", "extra"], ["pool", "get"], ["pool", "create", "x"],
            ["pool", "create", "x", "--format", "V41", "--block_size", "0",
             "--num_blocks", "1", "--num_layers", "1"],
            ["stats", "--bogus"], ["plan", "p"], ["inspect", "p"],
            ["inspect", "p", "--layer", "0"], ["verify"],
            ["verify", "p", "--layers", "x"], ["drain", "now"],
            ["status", "-o", "xml"], ["status", "--timeout", "soon"],
        ]
        for args in cases:
            start = time.time()
            rc, _, err = ctl(*args, *addr)
            self.assertEqual(rc, 2, (args, err))
            self.assertNotIn("cannot connect", err, args)
            self.assertLess(time.time() - start, 2.5, args)
        rc, _, err = ctl("status", *addr, "--timeout", "300ms")
        self.assertEqual(rc, 3, err)


class AddressTest(unittest.TestCase):
    def test_flag_beats_env_beats_default(self):
        d = Daemon()
        try:
            nowhere = "/tmp/kvctl-nowhere-%d.sock" % os.getpid()
            # env alone
            rc, out, err = ctl("status", env={"KVDEPOT_ADDR": d.sock})
            self.assertEqual(rc, 0, err)
            self.assertRegex(out, r"health:\s+SERVING")
            rc, _, _ = ctl("status", env={"KVDEPOT_ADDR": "unix:" + d.sock})
            self.assertEqual(rc, 0)
            # flag over env, both ways
            rc, _, err = ctl("status", "--addr", d.sock, "--timeout", "1s",
                             env={"KVDEPOT_ADDR": nowhere})
            self.assertEqual(rc, 0, err)
            rc, _, err = ctl("status", "--addr", nowhere, "--timeout", "1s",
                             env={"KVDEPOT_ADDR": d.sock})
            self.assertEqual(rc, 3)
            self.assertIn(nowhere, err)
            # neither: the default socket (of an empty runtime dir here)
            run = tempfile.mkdtemp(prefix="kvctl-xdg", dir="/tmp")
            rc, _, err = ctl("status", "--timeout", "1s",
                             env={"XDG_RUNTIME_DIR": run})
            shutil.rmtree(run)
            self.assertEqual(rc, 3)
            self.assertIn(run + "/kvdepot/kvdepotd.sock", err)
        finally:
            d.stop()


class VerifyDeadlineTest(unittest.TestCase):
    def test_a_slow_scan_outlives_the_unary_deadline(self):
        # 8 blocks at 800 ms each: 6.4 s, past the 5 s default of the
        # other commands.
        d = Daemon("--testonly_verify_block_delay_ms=800")
        try:
            self.assertEqual(ctl("pool", "create", "p", "--format", "V41",
                                 "--block_size", "1", "--num_blocks", "8",
                                 "--num_layers", "1", "--addr", d.sock)[0], 0)
            start = time.time()
            rc, out, err = ctl("verify", "p", "--addr", d.sock)
            self.assertEqual(rc, 0, err)
            self.assertGreater(time.time() - start, 5.5)
            self.assertRegex(out, r"blocks:\s+8 scanned, 0 with problems")
            rc, _, err = ctl("verify", "p", "--addr", d.sock, "--timeout",
                             "1s")
            self.assertEqual(rc, 1, err)
            self.assertIn("DEADLINE_EXCEEDED", err)
        finally:
            d.stop()


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1])
