#!/usr/bin/env python3
"""step_scheduler.py: the Python scheduler of step_benchmark (the same
protocol as step_scheduler.cc, which documents it).

  step_scheduler.py --socket=PATH --request=FILE

FILE holds one serialized kvdepot.v1.StepRequest. Per stdin line "<step_id>"
the script rebuilds the request's int32 arrays from its own arrays (as a
Python scheduler does each step), sends Step and answers "ok <queued>" or
"err <code> <msg>"; "q" answers "cpu_us <process CPU> steps <n>", counted
from the end of the first step (lazy setup) over the steps after it. Needs grpcio and protobuf; the stubs are the committed ones in
client/python/kvdepot/v1 (found beside this file under ../python or from the
repository).
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

_ARRAYS = ("slot_mapping", "compressed_slot_mapping", "seq_lens",
           "query_lens", "swa_state_ids", "swa_valid_starts", "block_tables")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--request", required=True)
    a = ap.parse_args()
    req = step_pb2.StepRequest()
    with open(a.request, "rb") as f:
        req.ParseFromString(f.read())
    values = {}
    for name in _ARRAYS:
        v = array.array("i")
        v.frombytes(getattr(req, name))
        values[name] = v
    opts = [("grpc.max_send_message_length", 64 << 20),
            ("grpc.max_receive_message_length", 64 << 20)]
    channel = grpc.insecure_channel("unix:" + a.socket, options=opts)
    stub = step_pb2_grpc.StepStub(channel)
    cpu0 = None
    steps = 0
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
        try:
            reply = stub.Step(req, timeout=10)
            line = "ok %d" % reply.queued
        except grpc.RpcError as e:
            line = "err %d %s" % (e.code().value[0], e.details())
        if cpu0 is None:
            cpu0 = time.process_time()  # the first step is not counted
        else:
            steps += 1
        print(line, flush=True)
    cpu = 0.0 if cpu0 is None else (time.process_time() - cpu0) * 1e6
    print("cpu_us %.1f steps %d" % (cpu, steps), flush=True)


if __name__ == "__main__":
    main()
