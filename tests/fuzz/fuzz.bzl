"""kvdepot_fuzz_test: one libFuzzer target and its committed seed corpus.

The normal build links the target with replay_main.cc as a cc_test that
replays corpus/<name>/ (so `bazel test //...` runs every seed). Under
--config=fuzz (clang, .bazelrc) the same source links with libFuzzer's main
instead; tools/fuzz.sh builds and runs it.
"""

def kvdepot_fuzz_test(name, srcs, deps = [], size = "small", **kwargs):
    corpus = "corpus/" + name
    native.cc_test(
        name = name,
        size = size,
        srcs = srcs,
        deps = deps + [":fuzz_input"] + select({
            ":fuzzing": [],
            "//conditions:default": [":replay_main"],
        }),
        linkopts = select({
            ":fuzzing": ["-fsanitize=fuzzer"],
            "//conditions:default": [],
        }),
        data = native.glob([corpus + "/**"]),
        args = ["tests/fuzz/" + corpus],
        **kwargs
    )
