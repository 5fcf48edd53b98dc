"""cuda_library: compiles .cu files with the local nvcc for Hopper.

When no CUDA toolkit was found (see cuda_configure.bzl) the macro defines
nothing, so CPU-only builds skip CUDA targets cleanly. BUILD files that
depend on a cuda_library guard those targets with CUDA_AVAILABLE, most
simply through cuda_only(cc_test, name = ..., ...), since BUILD files may not
use top-level if statements.

Each .cu becomes one object built with:
  -gencode arch=compute_90a,code=sm_90a   (Hopper SASS)
  -gencode arch=compute_90,code=compute_90 (PTX for forward compatibility)
and the result links the static CUDA runtime.
"""

load("@local_cuda//:defs.bzl", "CUDA_AVAILABLE", "NVCC")

NVCC_FLAGS = [
    "-std=c++20",
    "-O3",
    "-gencode arch=compute_90a,code=sm_90a",
    "-gencode arch=compute_90,code=compute_90",
    "-Xcompiler -fPIC",
    "-Xcompiler -Wall",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    # Bit-exact with the CPU reference: no fast math, IEEE division and sqrt.
    "-ftz=false",
    "-prec-div=true",
    "-prec-sqrt=true",
    "-fmad=false",
]

def cuda_library(name, srcs, hdrs = [], cuda_hdrs = [], deps = [], copts = [], visibility = None, testonly = False, alwayslink = False):
    """A cc_library whose sources are CUDA files.

    Args:
      name: target name.
      srcs: .cu files.
      hdrs: host-only headers exported to C++ users (no CUDA syntax).
      cuda_hdrs: labels (files or filegroups) of every header the .cu files include.
      deps: cc deps of the resulting library.
      copts: extra nvcc flags.
      visibility: as usual.
      testonly: as usual.
      alwayslink: as usual (objects nothing references by name still link).
    """
    if not CUDA_AVAILABLE:
        return
    objs = []
    for src in srcs:
        stem = src[:-len(".cu")]
        obj = "_cuda_objs/%s/%s.o" % (name, stem)
        native.genrule(
            name = "%s_%s_nvcc" % (name, stem.replace("/", "_")),
            srcs = [src] + hdrs + cuda_hdrs,
            outs = [obj],
            cmd = " ".join([NVCC] + NVCC_FLAGS + copts + [
                "-I.",
                "-I$(GENDIR)",
                "-c $(location %s)" % src,
                "-o $@",
            ]),
            testonly = testonly,
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:cudart_static"],
        linkstatic = True,
        visibility = visibility,
        testonly = testonly,
        alwayslink = alwayslink,
    )

def cuda_only(rule, **kwargs):
    """Instantiates `rule(**kwargs)` only when a CUDA toolkit was found.

    Args:
      rule: a rule or macro, e.g. cc_library, cc_test, cc_binary.
      **kwargs: its attributes.
    """
    if CUDA_AVAILABLE:
        rule(**kwargs)
