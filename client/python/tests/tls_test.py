"""The Python client over TCP: mutual TLS (certificates made with the
openssl command line, as server/tls_test_certs.cc does) and the
TcpSessions stream session whose identity is the certificate's subject,
against a real kvdepotd on 127.0.0.1:0."""

import os
import re
import signal
import subprocess
import tempfile
import time
import unittest

import grpc

import kvdepot


def _openssl(d: str, *args: str) -> None:
    r = subprocess.run(["openssl", *args], cwd=d, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise AssertionError(f"openssl {' '.join(args)}: "
                             f"{r.stdout.decode()}")


def make_ca(d: str, ca: str) -> None:
    _openssl(d, "req", "-x509", "-newkey", "ec", "-pkeyopt",
             "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj",
             f"/CN={ca}")


def make_cert(d: str, ca: str, name: str, cn: str) -> None:
    with open(os.path.join(d, "san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(d, "req", "-newkey", "ec", "-pkeyopt",
             "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}")
    _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem",
             "-CAkey", f"{ca}.key", "-CAcreateserial", "-out", f"{name}.pem",
             "-days", "2", "-extfile", "san.ext")


class TcpDaemon:
    """kvdepotd --listen=127.0.0.1:0 [flags]; `address` from its log."""

    def __init__(self, *flags: str):
        self.dir = tempfile.mkdtemp(prefix="kvtls")
        self.log_path = os.path.join(self.dir, "kvdepotd.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [os.environ["KVDEPOT_BIN"], "--listen=127.0.0.1:0", *flags],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        self.address = ""
        while not self.address:
            m = re.search(r"serving on (127\.0\.0\.1:\d+)", self.text())
            if m:
                self.address = m.group(1)
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("kvdepotd did not start: " + self.text())
            else:
                time.sleep(0.05)

    def text(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.log.close()
        return rc


CONFIG = """
pools { name: "shared" format: "BF16" elements: 4 block_size: 4
        num_blocks: 2 num_layers: 1 }
grants { pool: "shared" tls_subjects: "CN=worker-b" }
"""


class TlsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.certs = tempfile.mkdtemp(prefix="kvcerts")
        make_ca(cls.certs, "ca")
        make_ca(cls.certs, "rogue")
        make_cert(cls.certs, "ca", "server", "localhost")
        make_cert(cls.certs, "ca", "worker-a", "worker-a")
        make_cert(cls.certs, "ca", "worker-b", "worker-b")
        make_cert(cls.certs, "rogue", "mallory", "worker-a")
        config = os.path.join(cls.certs, "config.textproto")
        with open(config, "w") as f:
            f.write(CONFIG)
        cls.daemon = TcpDaemon(f"--tls_cert={cls.path('server.pem')}",
                               f"--tls_key={cls.path('server.key')}",
                               f"--tls_client_ca={cls.path('ca.pem')}",
                               f"--config={config}")

    @classmethod
    def tearDownClass(cls):
        assert cls.daemon.stop() == 0, cls.daemon.text()

    @classmethod
    def path(cls, name: str) -> str:
        return os.path.join(cls.certs, name)

    def tls(self, who: str, ca: str = "ca.pem") -> kvdepot.TLS:
        return kvdepot.TLS(ca=self.path(ca), cert=self.path(f"{who}.pem"),
                           key=self.path(f"{who}.key"))

    def connect(self, who: str, **options) -> kvdepot.Client:
        options.setdefault("connect_timeout", 20.0)
        return kvdepot.connect(self.daemon.address, tls=self.tls(who),
                               client_name=who, **options)

    def test_mutual_tls_session_identity_and_access(self):
        with self.connect("worker-a") as a, self.connect("worker-b") as b:
            # The stream session's identity is the certificate's subject.
            self.assertEqual(a.tls_subject, "CN=worker-a")
            self.assertEqual(b.tls_subject, "CN=worker-b")
            self.assertTrue(a.session_id and a.session_number)
            self.assertNotEqual(a.session_number, b.session_number)
            a.create_pool("mine", "BF16(4)", block_size=4, num_blocks=2,
                          num_layers=1)
            rows = bytes(range(16))
            self.assertEqual(a.store("mine", 0, [1, 2], rows), 2)
            self.assertEqual(a.load("mine", 0, segments=[[0, 1, 3, 0]],
                                    total_k=2).data, rows)
            # b may use the pool the config grants its subject, not a's.
            self.assertEqual(b.store("shared", 0, [0, 5], rows), 2)
            with self.assertRaises(kvdepot.KVCacheError) as cm:
                b.store("mine", 0, [0], rows[:8])
            self.assertEqual(cm.exception.code,
                             grpc.StatusCode.PERMISSION_DENIED,
                             cm.exception.message)
            # a grants b by subject-free session number: then b may.
            a.grant(pool="mine", sessions=[b.session_number])
            self.assertEqual(b.store("mine", 0, [0], rows[:8]), 1)
            # ... and a pool granted to its subject, in any of its sessions.
            a.create_pool("by_subject", "BF16(4)", block_size=4,
                          num_blocks=2, num_layers=1)
            with self.assertRaises(kvdepot.KVCacheError):
                b.store("by_subject", 0, [0], rows[:8])
            a.grant(pool="by_subject", tls_subjects=["CN=worker-b"])
            with self.connect("worker-b") as b2:
                self.assertEqual(b2.store("by_subject", 0, [0], rows[:8]), 1)
            # reconnect() opens a new stream session with the same identity.
            old = a.session_id
            a.reconnect()
            self.assertNotEqual(a.session_id, old)
            self.assertEqual(a.tls_subject, "CN=worker-a")
            self.assertEqual(a.store("mine", 0, [3], rows[:8]), 1)
            sessions = a.stats().sessions
        # close() cancelled both streams: the daemon ended the sessions.
        with self.connect("worker-a") as c:
            deadline = time.monotonic() + 10
            while c.stats().sessions >= sessions and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertEqual(c.stats().sessions, 1)

    def test_refused_without_a_trusted_client_certificate(self):
        addr = self.daemon.address
        for name, tls in (
                ("no client certificate",
                 kvdepot.TLS(ca=self.path("ca.pem"))),
                ("a certificate of another CA", self.tls("mallory")),
                ("plaintext", None)):
            with self.subTest(name):
                with self.assertRaises(kvdepot.KVCacheError) as cm:
                    kvdepot.connect(addr, tls=tls, connect_timeout=2.0)
                self.assertEqual(cm.exception.code,
                                 grpc.StatusCode.UNAVAILABLE,
                                 cm.exception.message)

    def test_bad_tls_options_are_refused_in_the_client(self):
        IA = grpc.StatusCode.INVALID_ARGUMENT
        cases = [
            ("cert and key go together",
             dict(address=self.daemon.address,
                  tls=kvdepot.TLS(ca=self.path("ca.pem"),
                                  cert=self.path("worker-a.pem")))),
            ("No such file",
             dict(address=self.daemon.address,
                  tls=kvdepot.TLS(ca=self.path("nothing.pem")))),
            ("is not PEM",
             dict(address=self.daemon.address,
                  tls=kvdepot.TLS(ca=self.path("san.ext")))),
            ("TLS is for TCP",
             dict(address="unix:/nonexistent/kv.sock", tls=self.tls("ca"))),
        ]
        for text, kwargs in cases:
            with self.subTest(text):
                with self.assertRaises(kvdepot.KVCacheError) as cm:
                    kvdepot.connect(**kwargs)
                self.assertEqual(cm.exception.code, IA)
                self.assertIn(text, cm.exception.message)


class LoopbackTest(unittest.TestCase):
    def test_anonymous_stream_session_lost_with_the_daemon(self):
        d = TcpDaemon()
        try:
            kv = kvdepot.connect(d.address, connect_timeout=20.0)
            self.assertEqual(kv.tls_subject, "")      # anonymous
            self.assertTrue(kv.session_id)
            kv.ping()
            self.assertEqual(kv.stats().sessions, 1)
            self.assertEqual(kv.keep_alive(), 0)   # a stream has no lease
        finally:
            self.assertEqual(d.stop(), 0, d.text())
        # The drain ended the stream: the session is lost, said once, and
        # every call says so until reconnect().
        deadline = time.monotonic() + 10
        while kv._tcp_ended is None and time.monotonic() < deadline:
            time.sleep(0.02)
        with self.assertRaises(kvdepot.SessionLost):
            kv.ping()
        with self.assertRaises(kvdepot.SessionLost):
            kv.stats()
        kv.close()
        with self.assertRaises(kvdepot.ClientClosed):
            kv.ping()

    def test_lease_sessions_stay_available(self):
        d = TcpDaemon()
        try:
            with kvdepot.connect(d.address, tcp_session="lease",
                                 lease_ms=60000,
                                 connect_timeout=20.0) as kv:
                self.assertGreater(kv.lease_ms, 0)
                self.assertGreater(kv.keep_alive(), 0)
            with self.assertRaises(kvdepot.KVCacheError) as cm:
                kvdepot.connect(d.address, tcp_session="udp")
            self.assertEqual(cm.exception.code,
                             grpc.StatusCode.INVALID_ARGUMENT)
        finally:
            self.assertEqual(d.stop(), 0, d.text())


if __name__ == "__main__":
    unittest.main()
