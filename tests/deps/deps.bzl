"""dependency_rule: the package boundaries of docs/ARCHITECTURE.md as a test.

A genquery (evaluated by Bazel over the real dependency graph at build time)
lists every path from a non-testonly cc_library whose label starts with
`from_prefix` to any target whose label starts with one of `to_prefixes`
(minus `allowed`). The rule's test passes when that list is empty; with
expect_violation = True (the self-test on tests/deps/fixture) it passes only
when the list names both ends, so the query itself cannot silently rot.

genquery only walks what `roots` reach, and its roots must be visible to
//tests/deps: the daemon, the CLI and the public libraries reach every
library of the shipped code (a library nothing ships is not checked).
"""

def _re(prefix):
    # "//server" matches //server:x and //server/sub:x, not //serverx;
    # "//kernels:" matches the package //kernels alone.
    if prefix.endswith(":"):
        return "^" + prefix
    return "^" + prefix + "[/:]"

def dependency_rule(name, roots, from_prefix, to_prefixes, allowed = [],
                    expect_violation = False):
    universe = " + ".join(roots)
    libs = 'attr(testonly, 0, kind("cc_library rule", deps(%s)))' % universe
    targets = " + ".join(
        ['filter("%s", deps(%s))' % (_re(p), universe) for p in to_prefixes],
    )
    if allowed:
        # An allowed library and its own files (depth 1), not what it uses.
        targets = "(%s) except deps(%s, 1)" % (targets, " + ".join(allowed))
    native.genquery(
        name = name + "_paths",
        expression = 'allpaths(filter("%s", %s), %s)' % (
            _re(from_prefix),
            libs,
            targets,
        ),
        scope = roots,
        testonly = True,
    )
    native.sh_test(
        name = name,
        size = "small",
        srcs = ["check_paths.sh"],
        args = [
            "$(location :%s_paths)" % name,
            from_prefix,
            ",".join(to_prefixes),
            "expect_violation" if expect_violation else "expect_none",
        ],
        data = [":%s_paths" % name],
    )
