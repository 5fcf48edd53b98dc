#!/usr/bin/env bash
# Rewrites the Python client's committed gRPC stubs (client/python/kvdepot/v1/
# *_pb2.py, *_pb2_grpc.py) from proto/kvdepot/v1/*.proto with Debian's protoc
# and grpc_python_plugin. Run it after changing a .proto;
# //client/python:stubs_fresh_test fails until you do.
set -euo pipefail
cd "$(dirname "$0")/.."
plugin="$(command -v grpc_python_plugin)" || {
  echo "grpc_python_plugin not found (Debian: protobuf-compiler-grpc)" >&2
  exit 1
}
out=client/python
rm -f "$out"/kvdepot/v1/*_pb2.py "$out"/kvdepot/v1/*_pb2_grpc.py
for proto in proto/kvdepot/v1/*.proto; do
  protoc --proto_path=proto --python_out="$out" --grpc_python_out="$out" \
    --plugin=protoc-gen-grpc_python="$plugin" "${proto#proto/}"
done
ls "$out"/kvdepot/v1/
