"""kvcachectl against a live kvdepot (CPU backend) on a temporary socket.

Every subcommand in table and JSON form; a corrupted block (a UE8M0 scale
set to 255 and a NaN in BF16 data, written through the mapped pool memfd) is
found by `verify` and shown by `inspect`; checksums are stable across scans
and change after a write; status exits 0 / 1 (draining) / 3 (no daemon);
/metrics is scraped during traffic and validated by `promtool check
metrics`.

Every -o json output is checked against the schema table of
docs/OPERATING.md ("JSON output"): each field documented, one type per
field name across all commands.

Usage (Bazel passes these): ops_test.py KVDEPOT KVCACHECTL TRAFFIC OPERATING_MD
"""

import json
import mmap
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

KVDEPOT, KVCACHECTL, TRAFFIC, OPERATING_MD = (
    os.path.abspath(p) for p in sys.argv[1:5])
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def ctl(*args, timeout=60):
    """Runs kvcachectl; returns (exit code, stdout, stderr)."""
    p = subprocess.run([KVCACHECTL, *args], capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


class Daemon:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="kvops", dir="/tmp")
        self.sock = os.path.join(self.dir, "d.sock")
        self.log_path = os.path.join(self.dir, "kvdepotd.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [KVDEPOT, "--listen=" + self.sock, "--backend=cpu",
             "--metrics_address=127.0.0.1:0", "--drain_grace_ms=0"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.metrics_url = None
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("kvdepotd exited: " + self.read_log())
            m = re.search(r"metrics on (http://\S+/metrics)", self.read_log())
            if m and os.path.exists(self.sock):
                self.metrics_url = m.group(1)
                rc, _, _ = ctl("status", "--addr", self.sock, "--timeout", "2s")
                if rc == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("kvdepot did not come up: " + self.read_log())

    def read_log(self):
        with open(self.log_path) as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def traffic(sock, pool, layer, first_slot, tokens, seed, rounds=1):
    return subprocess.run(
        [TRAFFIC, "--addr=" + sock, "--pool=" + pool, "--layer=%d" % layer,
         "--first_slot=%d" % first_slot, "--tokens=%d" % tokens,
         "--seed=%d" % seed, "--rounds=%d" % rounds],
        capture_output=True, text=True, timeout=120)


def record_offsets(info, layer, slot):
    """(data offset, scale offset) of a slot from the pool's mapping base."""
    l = info["layout"]
    bs = int(l["block_size"])
    block, t = divmod(slot, bs)
    base = (layer * int(l["layer_stride"])
            + block * int(l["block_stride"]))
    if l["token_interleaved"]:
        data = base + t * l["bytes_per_token"]
        return data, data + l["data_bytes"]
    return base + t * l["data_bytes"], base + bs * l["data_bytes"] + t * l["sf_bytes"]


def poke(sock, info, offset, payload):
    """Writes bytes into the pool's memory (as a buggy client could), mapped
    from the memfd the daemon hands over on the companion socket."""
    import kvdepot  # the Python client (ops_test.sh sets PYTHONPATH)

    with kvdepot.connect(sock) as c:
        m = c.map_pool(info["name"])
        m.view[offset:offset + len(payload)] = payload
        m.close()


def load_schema():
    """{field: type} from the json-schema table of docs/OPERATING.md."""
    with open(OPERATING_MD) as f:
        text = f.read()
    table = text.split("<!-- json-schema: begin")[1].split(
        "<!-- json-schema: end -->")[0]
    return dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", table, re.M))


def json_type(v):
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "float"
    if isinstance(v, dict):
        return "object"
    if isinstance(v, list):
        return "array"
    return "string"


def matches(value, typ):
    if typ.startswith("array of "):
        return isinstance(value, list) and all(
            matches(x, typ[len("array of "):]) for x in value)
    if typ == "float":
        return (json_type(value) in ("integer", "float") or
                value in ("NaN", "Infinity", "-Infinity"))
    if typ == "hex64":
        return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{16}", value)
    if typ == "hex":
        return isinstance(value, str) and re.fullmatch(r"([0-9a-f]{2})*", value)
    return json_type(value) == typ


def check_schema(test, command, tree, schema):
    """Every field of `tree` is in `schema` with a value of its type."""
    if isinstance(tree, list):
        for x in tree:
            check_schema(test, command, x, schema)
        return
    if not isinstance(tree, dict):
        return
    for k, v in tree.items():
        test.assertIn(k, schema, "%s: field %r is not in OPERATING.md's "
                      "JSON schema" % (command, k))
        test.assertTrue(matches(v, schema[k]), "%s: %s = %r is not %s" % (
            command, k, v, schema[k]))
        check_schema(test, command, v, schema)


JSON_SEEN = []  # (command, parsed output) of every -o json call


class OpsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = Daemon()
        cls.addr = ["--addr", cls.d.sock]

    @classmethod
    def tearDownClass(cls):
        cls.d.stop()

    def ctl_ok(self, *args):
        rc, out, err = ctl(*args, *self.addr)
        self.assertEqual(rc, 0, "kvcachectl %s: %s%s" % (args, out, err))
        return out

    def ctl_json(self, *args):
        j = json.loads(self.ctl_ok(*args, "-o", "json"))
        JSON_SEEN.append((args, j))
        return j

    def test_all(self):
        # One daemon, one ordered story (drain must come last).
        self.check_help()
        self.check_status_serving()
        self.check_pools()
        self.check_plan()
        self.check_verify_checksums()
        self.check_corruption()
        self.check_validation()
        self.check_metrics_during_traffic()
        self.check_stats()
        self.check_registrations()
        self.check_drain_and_exit_codes()
        self.check_json_schema()

    def check_json_schema(self):
        schema = load_schema()
        self.assertIn("xxh3", schema)
        commands = {args[0] if args[0] != "pool" else "pool " + args[1]
                    for args, _ in JSON_SEEN}
        self.assertTrue({"status", "pool create", "pool list", "pool get",
                         "pool delete", "plan", "verify", "inspect", "stats",
                         "drain"} <= commands, commands)
        for args, tree in JSON_SEEN:
            check_schema(self, " ".join(args), tree, schema)

    def check_help(self):
        for cmd in (["status"], ["pool"], ["pool", "list"], ["pool", "get"],
                    ["pool", "create"], ["pool", "delete"], ["stats"], ["plan"],
                    ["inspect"], ["verify"], ["drain"], ["format"],
                    ["registrations"]):
            rc, out, err = ctl(*cmd, "--help")
            self.assertEqual(rc, 0, (cmd, err))
            self.assertIn("Usage: kvcachectl", out, cmd)
        rc, _, err = ctl("status", "--bogus", *self.addr)
        self.assertEqual(rc, 2)
        self.assertIn('unknown flag "--bogus"', err)
        rc, _, err = ctl("frobnicate")
        self.assertEqual(rc, 2)
        rc, _, err = ctl("status", "-o", "xml", *self.addr)
        self.assertEqual(rc, 2)
        self.assertIn('--output = "xml" is not table, json or yaml', err)

    def check_status_serving(self):
        out = self.ctl_ok("status")
        self.assertRegex(out, r"health:\s+SERVING")
        self.assertRegex(out, r"backend:\s+cpu")
        self.assertRegex(out, r"version:\s+\d+\.\d+\.\d+")
        j = self.ctl_json("status")
        self.assertEqual(j["health"], "SERVING")
        self.assertTrue(j["serving"])
        self.assertEqual(j["stats"]["backend"], "cpu")

    def check_pools(self):
        self.ctl_ok("pool", "create", "mx", "--format", "MXFP8_INDEX",
                    "--block_size", "7", "--num_blocks", "5", "--num_layers", "2")
        out = self.ctl_ok("pool", "create", "bf", "--format", "BF16",
                          "--elements", "6", "--block_size", "3",
                          "--num_blocks", "4", "--num_layers", "1")
        self.assertIn('pool "bf" created', out)
        j = self.ctl_json("pool", "create", "tmp", "--format", "V41",
                          "--block_size", "17", "--num_blocks", "1",
                          "--num_layers", "1")
        self.assertEqual(j["name"], "tmp")
        self.assertEqual(j["layout"]["format"], "V41")
        out = self.ctl_ok("pool", "list")
        self.assertRegex(out, r"(?m)^NAME\s+FORMAT")
        self.assertRegex(out, r"(?m)^mx\s+MXFP8_INDEX\s+cpu\s+2\s+5\s+7")
        names = [p["name"] for p in self.ctl_json("pool", "list")["pools"]]
        self.assertEqual(names, ["bf", "mx", "tmp"])
        out = self.ctl_ok("pool", "get", "mx")
        self.assertRegex(out, r"blocks:\s+2 layers x 5 blocks x 7 slots")
        self.assertNotIn("shm:", out)  # never named (SPEC §11)
        j = self.ctl_json("pool", "delete", "tmp")
        self.assertEqual(j["deleted"], "tmp")
        rc, _, err = ctl("pool", "get", "tmp", *self.addr)
        self.assertEqual(rc, 1)
        self.assertIn("NOT_FOUND", err)
        rc, _, err = ctl("pool", "create", "bad", "--format", "V41",
                         "--block_size", "0", "--num_blocks", "1",
                         "--num_layers", "1", *self.addr)
        self.assertEqual(rc, 2)
        self.assertIn("--block_size", err)
        rc, _, err = ctl("pool", "create", "bad", "--format", "NOPE",
                         "--block_size", "3", "--num_blocks", "1",
                         "--num_layers", "1", *self.addr)
        self.assertEqual(rc, 1)
        self.assertIn("INVALID_ARGUMENT", err)
        self.assertIn("NOPE", err)
        self.mx = self.ctl_json("pool", "get", "mx")
        self.bf = self.ctl_json("pool", "get", "bf")

    def check_plan(self):
        out = self.ctl_ok("plan", "mx", "--seqlens", "5,9",
                          "--block_table", "0,1;2,3")
        self.assertRegex(out, r"(?m)^SEGMENT\s+SRC_BLOCK")
        self.assertIn("total_k: 14", out)
        j = self.ctl_json("plan", "mx", "--seqlens", "5,9",
                          "--block_table", "0,1;2,3")
        self.assertEqual(j["total_k"], 14)
        self.assertEqual(j["cu_rows"], [0, 5, 14])
        rows = sum(s[2] - s[1] for s in j["segments"])
        self.assertEqual(rows, 14)
        # Sequence 1 (9 tokens, B = 7): 7 rows of block 2, 2 rows of block 3.
        self.assertIn([2, 0, 7, 5], j["segments"])
        self.assertIn([3, 0, 2, 12], j["segments"])
        path = os.path.join(self.d.dir, "plan.json")
        with open(path, "w") as f:
            json.dump({"seqlen_k": [5, 9], "block_table": [[0, 1], [2, 3]]}, f)
        self.assertEqual(self.ctl_json("plan", "mx", "--file", path), j)
        rc, _, err = ctl("plan", "mx", "--seqlens", "5,9",
                         "--block_table", "0,1;2,9", *self.addr)
        self.assertEqual(rc, 1)
        self.assertIn("INVALID_ARGUMENT", err)
        self.assertIn("block_table[", err)

    def check_verify_checksums(self):
        for layer in (0, 1):
            r = traffic(self.d.sock, "mx", layer, 0, 35, 301 + layer)
            self.assertEqual(r.returncode, 0, r.stderr)
        r = traffic(self.d.sock, "bf", 0, 0, 12, 7)
        self.assertEqual(r.returncode, 0, r.stderr)
        a = self.ctl_json("verify", "mx")
        b = self.ctl_json("verify", "mx")
        # -o yaml is the same tree (a hash stays a string).
        out = self.ctl_ok("verify", "mx", "-o", "yaml")
        self.assertIn('\npool_xxh3: "%s"\n' % a["pool_xxh3"], out)
        self.assertEqual(a["blocks_total"], 10)
        self.assertEqual(a["blocks_with_issues"], 0)
        self.assertEqual(len(a["checksums"]), 10)
        self.assertEqual(a["checksums"], b["checksums"])
        self.assertEqual(a["pool_xxh3"], b["pool_xxh3"])
        self.assertEqual(len({c["xxh3"] for c in a["checksums"]}), 10)
        # A write to layer 1 block 2 (slots 14..20) changes that block only.
        r = traffic(self.d.sock, "mx", 1, 14, 7, 999)
        self.assertEqual(r.returncode, 0, r.stderr)
        c = self.ctl_json("verify", "mx")
        self.assertNotEqual(c["pool_xxh3"], a["pool_xxh3"])
        changed = [(x["layer"], x["block"]) for x, y in
                   zip(a["checksums"], c["checksums"]) if x["xxh3"] != y["xxh3"]]
        self.assertEqual(changed, [(1, 2)])
        # A terminal gets a progress bar on stderr; a pipe does not.
        master, slave = pty.openpty()
        p = subprocess.run([KVCACHECTL, "verify", "mx", "--progress_every", "1",
                            *self.addr], stdout=subprocess.PIPE, stderr=slave,
                           timeout=60)
        os.close(slave)
        bar = b""
        while select.select([master], [], [], 0.1)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            bar += chunk
        os.close(master)
        self.assertEqual(p.returncode, 0)
        self.assertIn(b"] 1/10 blocks", bar)
        self.assertIn(b"\r[" + b"#" * 40 + b"] 10/10 blocks", bar)
        rc, _, err = ctl("verify", "mx", "--progress_every", "1", *self.addr)
        self.assertNotIn("blocks\r", err)
        self.assertNotIn("#####", err)
        out = self.ctl_ok("verify", "mx", "--checksums", "--layers", "1")
        self.assertRegex(out, r"blocks:\s+5 scanned, 0 with problems")
        self.assertIn(c["checksums"][7]["xxh3"], out)

    def check_corruption(self):
        # A UE8M0 scale of 255 in mx layer 1 slot 24 (block 3, offset 3).
        _, sf = record_offsets(self.mx, 1, 24)
        poke(self.d.sock, self.mx, sf, b"\xff")
        # A BF16 NaN as element 2 of bf slot 5 (block 1, offset 2).
        data, _ = record_offsets(self.bf, 0, 5)
        poke(self.d.sock, self.bf, data + 4, b"\xc0\x7f")

        rc, out, err = ctl("verify", "mx", *self.addr)
        self.assertEqual(rc, 1, out + err)
        self.assertRegex(out, r"(?m)^1\s+3\s+24\s+1\s+")
        self.assertIn("slot 24: UE8M0 scale[0] = 0xff", out)
        self.assertIn("block(s) with problems in pool mx", err)
        rc, out, _ = ctl("verify", "mx", "-o", "json", *self.addr)
        self.assertEqual(rc, 1)
        j = json.loads(out)
        self.assertEqual(j["blocks_with_issues"], 1)
        self.assertEqual([(i["layer"], i["block"], i["slot"]) for i in j["issues"]],
                         [(1, 3, 24)])
        self.assertEqual(j["bad_scales"], 1)
        rc, out, _ = ctl("verify", "bf", "-o", "json", *self.addr)
        self.assertEqual(rc, 1)
        j = json.loads(out)
        self.assertEqual([(i["block"], i["slot"], i["nan_values"])
                          for i in j["issues"]], [(1, 5, 1)])
        # verify --layers 0 skips the bad layer.
        self.ctl_ok("verify", "mx", "--layers", "0")

        out = self.ctl_ok("inspect", "mx", "--layer", "1", "--slot", "24")
        self.assertRegex(out, r"(?m)^24\s+3\s+3\s+ff")
        self.assertIn("1 BAD", out)
        j = self.ctl_json("inspect", "mx", "--layer", "1", "--block", "3",
                          "--all")
        recs = j["records"]
        self.assertEqual([int(r["slot"]) for r in recs], list(range(21, 28)))
        bad = [r for r in recs if int(r["bad_scales"]) > 0]
        self.assertEqual([int(r["slot"]) for r in bad], [24])
        self.assertTrue(bad[0]["scale_hex"].startswith("ff"))
        self.assertEqual(len(recs[0]["values"]), int(j["layout"]["elements"]))
        self.assertTrue(any(v != 0 for v in recs[0]["values"]))
        j = self.ctl_json("inspect", "bf", "--layer", "0", "--slot", "5",
                          "--values", "3")
        rec = j["records"][0]
        self.assertEqual(int(rec["nan_count"]), 1)
        self.assertEqual(len(rec["values"]), 3)
        self.assertEqual(rec["values"][2], "NaN")

    def check_validation(self):
        cases = [
            (["inspect", "mx", "--layer", "2", "--slot", "0"],
             "layer = 2 is outside [0, 2)"),
            (["inspect", "mx", "--layer", "0", "--slot", "35"],
             "slot = 35 is outside [0, 35)"),
            (["inspect", "mx", "--layer", "0", "--block", "-1"],
             "block = -1 is outside [0, 5)"),
            (["inspect", "nope", "--layer", "0", "--block", "0"], "nope"),
            (["verify", "mx", "--layers", "1,1"],
             "layers[1] = 1 repeats layers[0]"),
            (["verify", "mx", "--layers", "0,7"],
             "layers[1] = 7 is outside [0, 2)"),
        ]
        for args, message in cases:
            rc, out, err = ctl(*args, *self.addr)
            self.assertEqual(rc, 1, (args, out, err))
            self.assertIn(message, err, args)
        # The field path travels as a google.rpc.BadRequest in the status
        # details; kvcachectl prints it under the message.
        rc, _, err = ctl("inspect", "mx", "--layer", "2", "--slot", "0",
                         *self.addr)
        self.assertIn("\n  field layer: layer = 2 is outside [0, 2)", err)
        rc, _, err = ctl("verify", "mx", "--layers", "0,7", *self.addr)
        self.assertIn("\n  field layers[1]: layers[1] = 7", err)
        rc, _, err = ctl("inspect", "mx", "--layer", "0", *self.addr)
        self.assertEqual(rc, 2)
        self.assertIn("exactly one of --slot and --block", err)

    def check_metrics_during_traffic(self):
        if not os.path.exists(PROMTOOL):
            self.fail("promtool not found (Debian package prometheus; "
                      "tools/deps.sh installs it)")
        t = threading.Thread(target=traffic,
                             args=(self.d.sock, "mx", 0, 0, 35, 5, 40))
        t.start()
        texts = []
        while t.is_alive() or not texts:
            with urllib.request.urlopen(self.d.metrics_url, timeout=10) as r:
                self.assertIn("text/plain", r.headers["Content-Type"])
                texts.append(r.read().decode())
        t.join()
        for text in (texts[0], texts[-1]):
            p = subprocess.run([PROMTOOL, "check", "metrics"], input=text,
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr + text)
        last = texts[-1]
        m = re.search(r'kvdepot_requests_total\{method="Store",code="OK"\} (\d+)',
                      last)
        self.assertIsNotNone(m, last)
        self.assertGreaterEqual(int(m.group(1)), 40)
        self.assertRegex(last, r"kvdepot_pools 2\n")
        self.assertRegex(last, r"kvdepot_tokens_stored_total [1-9]\d*\n")
        self.assertRegex(
            last, r'kvdepot_request_duration_seconds_bucket\{method="Load",'
                  r'le="\+Inf"\} [1-9]')
        self.assertRegex(last, r'kvdepot_rejections_total\{reason="invalid_argument"\} [1-9]')
        self.assertRegex(last, r'kvdepot_kernel_seconds_total\{op="store"\} ')
        # The step path's families are there on the CPU backend too.
        self.assertRegex(last, r"kvdepot_step_registrations 0\n")
        self.assertRegex(last, r"kvdepot_step_streams_open 0\n")
        self.assertRegex(last, r"kvdepot_step_streams_refused_total 0\n")

    def check_registrations(self):
        # No worker has registered with this daemon: the header alone, and
        # the help names every sticky status bit.
        out = self.ctl_ok("registrations")
        lines = out.strip().splitlines()
        self.assertEqual(len(lines), 1, out)
        for col in ("ID", "NAME", "LAYERS", "STATUS", "WATCHDOG",
                    "PHASE P50 US", "CANCELLED"):
            self.assertIn(col, lines[0])
        rc, out, err = ctl("registrations", "extra", *self.addr)
        self.assertEqual(rc, 2, (out, err))
        self.assertIn("takes no arguments", err)
        rc, out, _ = ctl("registrations", "--help")
        self.assertEqual(rc, 0)
        for bit in ("1 step-id", "2 cancelled", "4 out-of-range",
                    "8 worker watchdog", "16 daemon error"):
            self.assertIn(bit, out.replace("\n", " "))

    def check_stats(self):
        out = self.ctl_ok("stats")
        self.assertRegex(out, r"(?m)^METHOD\s+CALLS\s+ERRORS\s+MEAN\s+P50\s+P99")
        self.assertRegex(out, r"(?m)^Store\s+\d+\s+0\s+\d+us")
        self.assertRegex(out, r"(?m)^Inspect\s+\d+\s+[1-9]\d*\s.*INVALID_ARGUMENT:\d+\(\d+us\)")
        self.assertRegex(out, r"rejections:\s+.*invalid_argument:\d+")
        j = self.ctl_json("stats")
        rpcs = {r["rpc"]: r for r in j["rpcs"]}
        self.assertGreaterEqual(int(rpcs["Store"]["calls"]), 40)
        self.assertEqual(sum(int(b) for b in rpcs["Store"]["latency_buckets"]),
                         int(rpcs["Store"]["calls"]))
        self.assertEqual(sum(int(c["total_latency_us"]) for c in rpcs["Store"]["codes"]),
                         int(rpcs["Store"]["total_latency_us"]))
        self.assertGreater(int(j["tokens_stored"]), 0)
        self.assertGreater(int(j["bytes_loaded"]), 0)
        self.assertIn("invalid_argument", [r["reason"] for r in j["rejections"]])

    def check_drain_and_exit_codes(self):
        j = self.ctl_json("drain")
        self.assertTrue(j["started"])
        out = self.ctl_ok("drain")
        self.assertRegex(out, r"draining:\s+already draining")
        rc, out, err = ctl("status", *self.addr)
        self.assertEqual(rc, 1, out + err)
        self.assertRegex(out, r"health:\s+NOT_SERVING")
        self.assertRegex(out, r"draining:\s+yes")
        rc, out, _ = ctl("status", "-o", "json", *self.addr)
        self.assertEqual(rc, 1)
        self.assertEqual(json.loads(out)["health"], "NOT_SERVING")
        r = traffic(self.d.sock, "mx", 0, 0, 1, 1)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("draining", r.stderr)
        # Reads keep working while drained.
        self.ctl_ok("pool", "list")
        self.ctl_ok("inspect", "mx", "--layer", "0", "--slot", "0")
        j = self.ctl_json("stats")
        self.assertTrue(j["draining"])
        self.assertIn("draining", [r["reason"] for r in j["rejections"]])
        self.d.proc.send_signal(signal.SIGTERM)
        self.assertEqual(self.d.proc.wait(timeout=60), 0)
        rc, _, err = ctl("status", "--timeout", "1s", *self.addr)
        self.assertEqual(rc, 3, err)
        rc, _, err = ctl("pool", "list", "--timeout", "1s", *self.addr)
        self.assertEqual(rc, 3, err)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1])
