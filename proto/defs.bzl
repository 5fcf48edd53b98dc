"""Protocol Buffers and gRPC C++ code generation with Debian's protoc.

Bazel's own proto rules would download protobuf; this macro runs the system
protoc and grpc_cpp_plugin from a genrule instead. For `name = "kvdepot"` and
`src = "kvdepot/v1/kvdepot.proto"` it defines:
  kvdepot_proto     the .proto file (for other generators, e.g. Python)
  kvdepot_cc_proto  cc_library with the message classes
  kvdepot_cc_grpc   cc_library with the service stubs
Generated headers are included as "kvdepot/v1/kvdepot.pb.h".
"""

def cc_grpc_proto(name, src, visibility = None):
    base = src[:-len(".proto")]
    pkg = native.package_name()
    native.filegroup(
        name = name + "_proto",
        srcs = [src],
        visibility = visibility,
    )
    native.genrule(
        name = name + "_cc_gen",
        srcs = [src],
        outs = [
            base + ".pb.h",
            base + ".pb.cc",
            base + ".grpc.pb.h",
            base + ".grpc.pb.cc",
        ],
        cmd = " ".join([
            "protoc",
            "--proto_path=" + pkg,
            "--cpp_out=$(GENDIR)/" + pkg,
            "--grpc_out=$(GENDIR)/" + pkg,
            "--plugin=protoc-gen-grpc=$$(command -v grpc_cpp_plugin)",
            "$(location " + src + ")",
        ]),
    )
    native.cc_library(
        name = name + "_cc_proto",
        srcs = [base + ".pb.cc"],
        hdrs = [base + ".pb.h"],
        includes = ["."],
        copts = ["-Wno-unused-parameter"],
        visibility = visibility,
        deps = ["//third_party/system:protobuf"],
    )
    native.cc_library(
        name = name + "_cc_grpc",
        srcs = [base + ".grpc.pb.cc"],
        hdrs = [base + ".grpc.pb.h"],
        includes = ["."],
        visibility = visibility,
        deps = [
            ":" + name + "_cc_proto",
            "//third_party/system:grpc++",
        ],
    )
