#!/usr/bin/env bash
# The committed stubs (kvdepot/v1/) must be byte-identical to what protoc
# writes from the .proto files now (//client/python:stubs under gen/).
set -euo pipefail
pkg=client/python
status=0
for f in kvdepot_pb2.py kvdepot_pb2_grpc.py step_pb2.py step_pb2_grpc.py; do
  committed="$pkg/kvdepot/v1/$f"
  fresh="$pkg/gen/kvdepot/v1/$f"
  [ -f "$fresh" ] || { echo "FAIL: $fresh was not generated" >&2; exit 1; }
  if ! cmp -s "$committed" "$fresh"; then
    echo "FAIL: $committed is stale against proto/kvdepot/v1/;" \
      "run tools/regen_python_stubs.sh and commit the result" >&2
    status=1
  else
    echo "ok: $committed"
  fi
done
exit "$status"
