"""Repository rule that finds a local CUDA toolkit without downloading anything.

Generates @local_cuda with:
  defs.bzl   CUDA_AVAILABLE (bool) and NVCC (absolute path or "").
  :cuda_headers  the toolkit's include directory (only when available).
  :cudart_static the static CUDA runtime and the libraries it needs.
Set KVDEPOT_DISABLE_CUDA=1 to force a CPU-only build; CUDA_PATH overrides
the default /usr/local/cuda.
"""

def _cuda_configure_impl(ctx):
    disabled = ctx.os.environ.get("KVDEPOT_DISABLE_CUDA", "") not in ("", "0")
    root = ctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    nvcc = ctx.path(root + "/bin/nvcc")
    cudart = ctx.path(root + "/lib64/libcudart_static.a")
    available = (not disabled) and nvcc.exists and cudart.exists

    ctx.file("defs.bzl", "CUDA_AVAILABLE = %s\nNVCC = \"%s\"\n" % (
        "True" if available else "False",
        str(nvcc) if available else "",
    ))
    if not available:
        ctx.file("BUILD.bazel", "# No CUDA toolkit found: CPU-only build.\n")
        return

    ctx.symlink(root + "/include", "include")
    ctx.symlink(cudart, "lib/libcudart_static.a")
    ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "cuda_headers",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.inl"]),
    includes = ["include"],
)

cc_library(
    name = "cudart_static",
    srcs = ["lib/libcudart_static.a"],
    linkopts = ["-ldl", "-lpthread", "-lrt"],
    deps = [":cuda_headers"],
)
""")

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_PATH", "KVDEPOT_DISABLE_CUDA"],
    local = True,
)
