"""kvdepotd's face as a new user meets it (issue 11 items 1-3, 7, 8).

--help/-h/--version; bad flags, ports and config files refused with exit 2
and a message naming the flag (the config's line and column); a failed
start logs neither "draining" nor "stopped"; the metrics port is exclusive
and serves /healthz (200 SERVING, 503 while draining); logs on stderr with
zoned ISO 8601 timestamps, as text or JSON, with a client's pool name
escaped; grpc.health answers for "" and "kvdepot.v1.KVCache".

Usage (Bazel passes these): daemon_cli_test.py KVDEPOTD KVCACHECTL
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request

import grpc

KVDEPOTD, KVCACHECTL = (os.path.abspath(p) for p in sys.argv[1:3])
ISO_ZONED = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}[+-]\d\d:\d\d"


def run(*args, timeout=30):
    p = subprocess.run([KVDEPOTD, *args], capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def wait_for(predicate, what, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("timed out waiting for " + what)


class Daemon:
    """kvdepotd on a temporary socket, stderr captured to a file."""

    def __init__(self, *flags):
        self.dir = tempfile.mkdtemp(prefix="kvcli", dir="/tmp")
        self.sock = os.path.join(self.dir, "d.sock")
        self.err_path = os.path.join(self.dir, "stderr")
        self.out_path = os.path.join(self.dir, "stdout")
        with open(self.err_path, "w") as err, open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(
                [KVDEPOTD, "--listen=" + self.sock, "--backend=cpu",
                 "--drain_grace_ms=0", *flags], stdout=out, stderr=err)
        wait_for(lambda: "serving on" in self.stderr() or
                 self.proc.poll() is not None, "kvdepotd to start")
        if self.proc.poll() is not None:
            raise RuntimeError("kvdepotd exited: " + self.stderr())
        m = re.search(r"metrics on http://(\S+)/metrics", self.stderr())
        self.metrics = m.group(1) if m else None

    def stderr(self):
        with open(self.err_path) as f:
            return f.read()

    def stdout(self):
        with open(self.out_path) as f:
            return f.read()

    def stop(self):
        """SIGTERM; returns (stdout, stderr) of the whole run."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
        logs = self.stdout(), self.stderr()
        shutil.rmtree(self.dir, ignore_errors=True)
        return logs


def health(sock, service):
    """grpc.health.v1.Health/Check(service): the raw status enum."""
    with grpc.insecure_channel("unix:" + sock) as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check")
        name = service.encode()
        reply = check(b"\x0a" + bytes([len(name)]) + name if name else b"",
                      timeout=10)
        return reply[1] if reply else 0


def http_get(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class HelpAndVersionTest(unittest.TestCase):
    def test_help_lists_every_flag_of_main(self):
        # Every flag of server/main.cc, as absl's --helpfull lists them.
        _, full, _ = run("--helpfull")
        section = full.split("server/main.cc:")[1].split("\n\n")[0]
        flags = re.findall(r"^\s+--(\w+) ", section, re.M)
        self.assertIn("log_format", flags)
        self.assertGreaterEqual(len(flags), 15)
        for arg in ("--help", "-h"):
            rc, out, err = run(arg)
            self.assertEqual(rc, 0, err)
            self.assertIn("KV-cache daemon", out)
            self.assertIn("Usage: kvdepotd", out)
            for f in flags:
                self.assertIn("  --%s (" % f, out)
            self.assertNotIn("No flags matched", out)

    def test_version(self):
        rc, out, _ = run("--version")
        self.assertEqual(rc, 0)
        self.assertRegex(out, r"^kvdepotd \d+\.\d+\.\d+\n$")


class BadFlagsTest(unittest.TestCase):
    def assert_refused(self, args, message):
        rc, out, err = run(*args)
        self.assertEqual(rc, 2, (args, out, err))
        self.assertIn(message, err, args)
        self.assertNotIn("draining", err)
        self.assertNotIn("stopped", err)
        self.assertNotIn("serving on", err)

    def test_bad_values_exit_2_naming_the_flag(self):
        self.assert_refused(["--log_level=verbose"],
                            '--log_level = "verbose" is not one of')
        self.assert_refused(["--log_format=xml"], '--log_format = "xml"')
        self.assert_refused(["--listen=127.0.0.1:99999"],
                            'port "99999" is outside [1, 65535]')
        self.assert_refused(["--metrics_address=0.0.0.0:70000"],
                            '--metrics_address = "0.0.0.0:70000"')
        self.assert_refused(["--metrics_address=nonsense"],
                            "is not host:port")
        self.assert_refused(["--bogus=1"], 'unknown flag "--bogus=1"')
        self.assert_refused(["--lease_ms=ten"], '--lease_ms = "ten"')
        self.assert_refused(["serve"], 'unexpected argument "serve"')
        self.assert_refused(["--step_timing_every=-1"],
                            "--step_timing_every must be >= 0")
        for bad in ("-1", "2048"):
            self.assert_refused(["--malloc_keep_freed_mb=" + bad],
                                "--malloc_keep_freed_mb must be in [0, 2047]")

    def test_config_errors_carry_line_and_column(self):
        d = tempfile.mkdtemp(prefix="kvcfg", dir="/tmp")
        try:
            path = os.path.join(d, "bad.textproto")
            with open(path, "w") as f:
                f.write('pools {\n  name: "a"\n  blok_size: 3\n}\n')
            sock = os.path.join(d, "s.sock")
            self.assert_refused(
                ["--config=" + path, "--listen=" + sock, "--backend=cpu"],
                "line 3 column 12")
            rc, _, err = run("--config=" + path, "--listen=" + sock,
                             "--backend=cpu")
            self.assertIn('no field named "blok_size"', err)
            self.assert_refused(
                ["--config=" + os.path.join(d, "missing"), "--listen=" + sock,
                 "--backend=cpu"], "cannot read")
            self.assertFalse(os.path.exists(sock))
        finally:
            shutil.rmtree(d)


class RunningDaemonTest(unittest.TestCase):
    def test_metrics_port_is_exclusive_and_serves_healthz(self):
        a = Daemon("--metrics_address=127.0.0.1:0")
        try:
            port = a.metrics.rsplit(":", 1)[1]
            b_dir = tempfile.mkdtemp(prefix="kvcli", dir="/tmp")
            rc, _, err = run("--listen=" + os.path.join(b_dir, "b.sock"),
                             "--backend=cpu",
                             "--metrics_address=127.0.0.1:" + port)
            shutil.rmtree(b_dir)
            self.assertEqual(rc, 1, err)
            self.assertIn("the port is in use", err)
            self.assertNotIn("draining", err)
            self.assertEqual(http_get("http://%s/healthz" % a.metrics),
                             (200, "SERVING\n"))
            self.assertEqual(health(a.sock, ""), 1)
            self.assertEqual(health(a.sock, "kvdepot.v1.KVCache"), 1)
            with self.assertRaises(grpc.RpcError) as e:
                health(a.sock, "no.such.Service")
            self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
            rc = subprocess.run([KVCACHECTL, "drain", "--addr", a.sock],
                                capture_output=True).returncode
            self.assertEqual(rc, 0)
            self.assertEqual(http_get("http://%s/healthz" % a.metrics),
                             (503, "NOT_SERVING\n"))
            self.assertEqual(health(a.sock, "kvdepot.v1.KVCache"), 2)
        finally:
            a.stop()

    def test_tcp_port_is_exclusive(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        a = Daemon("--listen=127.0.0.1:%d" % port)
        try:
            rc, _, err = run("--listen=127.0.0.1:%d" % port, "--backend=cpu")
            self.assertEqual(rc, 1, err)
            self.assertIn("cannot listen", err)
        finally:
            a.stop()

    def test_text_logs_on_stderr_escape_a_clients_pool_name(self):
        a = Daemon()
        try:
            evil = "x\n2099-01-01T00:00:00 info forged \x1b[31mred"
            p = subprocess.run([KVCACHECTL, "pool", "get", evil, "--addr",
                                a.sock], capture_output=True, text=True)
            self.assertEqual(p.returncode, 1, p.stderr)
            wait_for(lambda: "rpc=GetPool" in a.stderr(), "the GetPool line")
        finally:
            out, err_lines = a.stop()
        for line in err_lines.splitlines():
            self.assertRegex(line, "^" + ISO_ZONED + " (info|warning|error) "
                             "kvdepotd ")
        self.assertNotIn("\x1b", err_lines)
        self.assertNotIn("\nforged", err_lines)
        self.assertIn('pool="x\\x0a2099-01-01T00:00:00 info forged '
                      '\\x1b[31mred"', err_lines)
        self.assertEqual(out, "")

    def test_json_logs(self):
        a = Daemon("--log_format=json")
        try:
            subprocess.run([KVCACHECTL, "pool", "get", 'q"\n', "--addr",
                            a.sock], capture_output=True)
            wait_for(lambda: "rpc=GetPool" in a.stderr(), "the GetPool line")
        finally:
            _, err = a.stop()
        records = [json.loads(l) for l in err.splitlines()]
        self.assertGreater(len(records), 3)
        for r in records:
            self.assertEqual(set(r), {"time", "level", "logger", "msg"})
            self.assertRegex(r["time"], "^" + ISO_ZONED + "$")
        get = [r for r in records if "rpc=GetPool" in r["msg"]]
        self.assertEqual(get[0]["level"], "info")
        self.assertIn('pool="q\\x22\\x0a"', get[0]["msg"])
        self.assertIn("kvdepot stopped", records[-1]["msg"])


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1])
