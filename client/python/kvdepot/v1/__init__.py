"""Generated gRPC stubs of the kvdepot.v1 protocol (proto/kvdepot/v1/).

Written by tools/regen_python_stubs.sh with Debian 12's protoc and
grpc_python_plugin; //client/python:stubs_fresh_test fails when they are
stale. Do not edit the *_pb2*.py files by hand.
"""
