#!/usr/bin/env python3
"""step_scheduler.py: the Python scheduler of step_benchmark (the same
protocol as step_scheduler.cc, which documents it).

  step_scheduler.py --socket=PATH --request=FILE [--in_flight_retry_ms=MS]
                    [--malloc_keep_freed_mb=MB] [--api=unary|ring]

FILE holds one serialized kvdepot.v1.StepRequest. Per stdin line "<step_id>"
the script rebuilds the request's int32 arrays from its own arrays (as a
Python scheduler does each step), sends Step and answers "ok <queued>" or
"err <code> <msg>"; "q" answers "cpu_us <process CPU> steps <n> retries <r>",
counted from the end of the first step (lazy setup) over the steps after it.
A Step refused with RESOURCE_EXHAUSTED (two steps of the registration in
flight: the daemon's completion report of step s can come after the worker
finished it) is sent again with a short backoff for up to
--in_flight_retry_ms, as step_send_retry.h does for the C++ scheduler (it
says why); <r> counts those sends. --malloc_keep_freed_mb (default 64; 0 =
glibc's defaults) is kvdepot.keep_freed_memory, as step_scheduler.cc's flag
of that name. --api=ring sends through a kvdepot.step.StepRing instead of
a unary Step per step: its own session, granted the registration by the
request's session at start (as step_scheduler.cc --api=ring). Needs grpcio
and protobuf; the stubs are
the committed ones in client/python/kvdepot/v1 (found beside this file under
../python or from the repository).
"""
import argparse
import array
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.join(_here, "..", "python"),
           os.path.join(_here, "..", "..", "client", "python")):
    if os.path.isdir(os.path.join(_p, "kvdepot")):
        sys.path.insert(0, _p)
        break

import grpc  # noqa: E402
from kvdepot.v1 import step_pb2, step_pb2_grpc  # noqa: E402

# step_send_retry.h's InFlightRetry: first backoff, its cap (seconds).
_FIRST_BACKOFF = 20e-6
_MAX_BACKOFF = 1e-3

_ARRAYS = ("slot_mapping", "compressed_slot_mapping", "seq_lens",
           "query_lens", "swa_state_ids", "swa_valid_starts", "block_tables")


def send_respecting_depth(send, budget_s):
    """Calls send() until it raises anything but RESOURCE_EXHAUSTED or
    budget_s has passed since the first refusal. Returns (reply, None,
    retries) or (None, the last grpc.RpcError, retries)."""
    retries = 0
    give_up = None
    backoff = _FIRST_BACKOFF
    while True:
        try:
            return send(), None, retries
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                return None, e, retries
            now = time.monotonic()
            if give_up is None:
                give_up = now + budget_s
            if now >= give_up:
                return None, e, retries
            time.sleep(min(backoff, give_up - now))
            backoff = min(2 * backoff, _MAX_BACKOFF)
            retries += 1


def open_ring(socket, stub, req, retry_s, grant):
    """--api=ring: a session of this process, granted the registration by
    the request's session; a ring sized for the request twice over; the
    request's session id cleared (a ring's requests run as its session)."""
    import kvdepot
    import kvdepot.step
    kv = kvdepot.connect(socket, client_name="step_scheduler.py")
    if grant:
        stub.GrantRegistration(step_pb2.GrantRegistrationRequest(
            session_id=req.session_id, registration_id=req.registration_id,
            sessions=[kv.session_number]), timeout=10)
    size = max(4096, (2 * req.ByteSize() + 63) // 64 * 64)
    ring = kvdepot.step.StepRing(kv, slots=4, request_bytes=size,
                                 in_flight_retry_s=retry_s)
    req.session_id = ""
    return ring


def ring_step(ring, req):
    """One step through the ring: its answer line."""
    import kvdepot
    try:
        return "ok %d" % ring.step(req).queued
    except kvdepot.KVCacheError as e:
        return "err %d %s" % (e.code.value[0], e.message)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--request", required=True)
    ap.add_argument("--in_flight_retry_ms", type=int, default=10000)
    ap.add_argument("--malloc_keep_freed_mb", type=int, default=64)
    ap.add_argument("--api", choices=("unary", "ring"), default="unary")
    ap.add_argument("--ring_grant", choices=("true", "false"),
                    default="true",
                    help="--api=ring: have the request's session grant the "
                    "registration to the ring's session at start")
    a = ap.parse_args()
    if a.malloc_keep_freed_mb:
        import kvdepot
        if not kvdepot.keep_freed_memory(a.malloc_keep_freed_mb):
            print("step_scheduler.py: --malloc_keep_freed_mb: refused by "
                  "the C library", file=sys.stderr)
    req = step_pb2.StepRequest()
    with open(a.request, "rb") as f:
        req.ParseFromString(f.read())
    values = {}
    for name in _ARRAYS:
        v = array.array("i")
        v.frombytes(getattr(req, name))
        values[name] = v
    # Several compressed ratios: one slot mapping per `compressed` entry,
    # refilled each step like the other arrays.
    entries = []
    for e in req.compressed:
        v = array.array("i")
        v.frombytes(e.slot_mapping)
        entries.append((e, v))
    opts = [("grpc.max_send_message_length", 64 << 20),
            ("grpc.max_receive_message_length", 64 << 20)]
    channel = grpc.insecure_channel("unix:" + a.socket, options=opts)
    stub = step_pb2_grpc.StepStub(channel)
    ring = None
    if a.api == "ring":
        ring = open_ring(a.socket, stub, req, a.in_flight_retry_ms / 1000.0,
                         a.ring_grant == "true")
    cpu0 = None
    steps = 0
    retries = 0
    for line in sys.stdin:
        line = line.strip()
        if line == "q":
            break
        try:
            step_id = int(line)
        except ValueError:
            print("err 3 bad line", flush=True)
            continue
        req.step_id = step_id
        for name, v in values.items():
            setattr(req, name, v.tobytes())
        for e, v in entries:
            e.slot_mapping = v.tobytes()
        if ring is not None:
            line = ring_step(ring, req)
        else:
            reply, err, n = send_respecting_depth(
                lambda: stub.Step(req, timeout=10),
                a.in_flight_retry_ms / 1000.0)
            retries += n
            if err is None:
                line = "ok %d" % reply.queued
            else:
                line = "err %d %s" % (err.code().value[0], err.details())
                if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    line += (" (still refused after %d retries over %d ms)"
                             % (n, a.in_flight_retry_ms))
        if cpu0 is None:
            cpu0 = time.process_time()  # the first step is not counted
        else:
            steps += 1
        print(line, flush=True)
    if ring is not None:
        retries = ring.retries
        ring.close()
    cpu = 0.0 if cpu0 is None else (time.process_time() - cpu0) * 1e6
    print("cpu_us %.1f steps %d retries %d" % (cpu, steps, retries),
          flush=True)


if __name__ == "__main__":
    main()
