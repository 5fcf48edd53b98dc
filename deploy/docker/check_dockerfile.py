#!/usr/bin/env python3
"""Offline lint of deploy/docker/Dockerfile (no Docker engine needed).

Usage: check_dockerfile.py DOCKERFILE REPO_ROOT [RUN_SCRIPTS_DIR]

Checks the rules the image depends on and prints one line per problem:
  - every stage is named, `COPY --from` names an earlier stage, base images
    are pinned tags (no `latest`), nothing is fetched with ADD;
  - every RUN starts with `set -e...` so a failing step fails the build;
  - build-context COPY sources exist and are not excluded by the
    Dockerfile's .dockerignore;
  - the build stage runs tools/deps.sh's installer and builds exactly the
    two binaries, which exist as Bazel targets, then deploy/docker/bundle.sh;
  - the final stage runs as a fixed numeric non-root UID:GID (65532, the
    group deploy/k8s relies on), ENTRYPOINT and HEALTHCHECK are exec-form
    JSON arrays: the daemon on unix:/run/kvdepot/daemon/kvdepotd.sock and the
    probe command of /tmp/iface.md, with a timeout above kvcachectl's 5 s.
With RUN_SCRIPTS_DIR, each RUN body is also written there as run_N.sh (for
shellcheck). Exit 0 when clean, 1 otherwise.
"""
import fnmatch
import json
import os
import re
import sys

UID = "65532"
SOCKET = "unix:/run/kvdepot/daemon/kvdepotd.sock"
PROBE = ["/usr/local/bin/kvcachectl", "status", "--addr", SOCKET]
TARGETS = {"//server:kvdepotd": "server", "//client/kvcachectl:kvcachectl": "client/kvcachectl"}


def instructions(text):
    """Yields (line_number, KEYWORD, arguments) with continuations joined."""
    buf, start = "", 0
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "  # Docker joins continued lines
            continue
        buf += stripped
        keyword, _, args = buf.partition(" ")
        yield start, keyword.upper(), args.strip()
        buf = ""
    if buf:
        yield start, "UNTERMINATED", buf


def ignored(path, patterns):
    result = False
    for pat in patterns:
        neg = pat.startswith("!")
        p = pat[1:] if neg else pat
        p = p.rstrip("/")
        if p.startswith("**/"):
            hit = any(fnmatch.fnmatch(part, p[3:]) for part in path.split("/"))
        else:
            hit = fnmatch.fnmatch(path, p) or path.startswith(p + "/")
        if hit:
            result = not neg
    return result


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    dockerfile, root = argv[1], argv[2]
    run_dir = argv[3] if len(argv) > 3 else None
    text = open(dockerfile, encoding="utf-8").read()
    ignore_file = dockerfile + ".dockerignore"
    patterns = []
    if os.path.exists(ignore_file):
        for line in open(ignore_file, encoding="utf-8"):
            line = line.strip()
            if line and not line.startswith("#"):
                patterns.append(line)

    errors = []
    if not patterns:
        errors.append(f"{ignore_file}: missing or empty")
    args = {}
    stages = []
    stage_insts = {}
    runs = []
    for n, kw, rest in instructions(text):
        at = f"line {n}"
        if kw == "UNTERMINATED":
            errors.append(f"{at}: instruction ends with a line continuation")
            continue
        if kw == "ARG":
            name, _, default = rest.partition("=")
            if stages:
                stage_insts[stages[-1]].append((n, kw, rest))
            else:
                args[name] = default
            continue
        if kw == "FROM":
            m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest, re.IGNORECASE)
            if not m:
                errors.append(f"{at}: FROM without a stage name (AS name)")
                continue
            image = re.sub(r"\$\{(\w+)\}", lambda v: args.get(v.group(1), ""), m.group(1))
            if ":" not in image.split("/")[-1] or image.endswith(":latest"):
                errors.append(f"{at}: base image {image!r} is not a pinned tag")
            if m.group(2) in stages:
                errors.append(f"{at}: stage {m.group(2)} defined twice")
            stages.append(m.group(2))
            stage_insts[m.group(2)] = []
            continue
        if not stages:
            errors.append(f"{at}: {kw} before the first FROM")
            continue
        stage_insts[stages[-1]].append((n, kw, rest))
        if kw == "ADD":
            errors.append(f"{at}: use COPY (and curl with checks for downloads), not ADD")
        if kw == "RUN":
            if rest.startswith("["):
                errors.append(f"{at}: exec-form RUN cannot `set -e`")
            elif not re.match(r"set -[a-z]*e", rest):
                errors.append(f"{at}: RUN does not start with `set -e...`")
            runs.append((n, rest))
        if kw == "COPY":
            parts = rest.split()
            flags = [p for p in parts if p.startswith("--")]
            paths = [p for p in parts if not p.startswith("--")]
            src_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
            if src_stage is not None:
                if src_stage not in stages[:-1]:
                    errors.append(f"{at}: COPY --from={src_stage} names no earlier stage")
                continue
            for src in paths[:-1]:
                rel = os.path.normpath(src).lstrip("./") if src not in (".", "./") else "."
                if rel == ".":
                    continue
                if not os.path.exists(os.path.join(root, rel)):
                    errors.append(f"{at}: COPY source {src} does not exist in the repository")
                elif ignored(rel, patterns):
                    errors.append(f"{at}: COPY source {src} is excluded by {ignore_file}")

    if stages[:1] != ["build"] or stages[-1:] != ["runtime"]:
        errors.append(f"stages are {stages}, want build first and runtime last")
    build = "\n".join(r for _, kw, r in stage_insts.get("build", []) if kw == "RUN")
    deps = open(os.path.join(root, "tools/deps.sh"), encoding="utf-8").read()
    fn = re.search(r"source tools/deps.sh && (\w+)", build)
    if not fn or not re.search(rf"^{fn.group(1)}\(\)", deps, re.MULTILINE):
        errors.append("build stage does not call an installer function of tools/deps.sh")
    built = re.findall(r"bazel [^;]*\bbuild\b[^;]*", build)
    labels = set(re.findall(r"//[\w/]+:\w+", " ".join(built)))
    if labels != set(TARGETS):
        errors.append(f"build stage builds {sorted(labels)}, want {sorted(TARGETS)}")
    for label, pkg in TARGETS.items():
        name = label.split(":")[1]
        build_file = open(os.path.join(root, pkg, "BUILD.bazel"), encoding="utf-8").read()
        if not re.search(rf'name = "{name}"', build_file):
            errors.append(f"{label} is not defined in {pkg}/BUILD.bazel")
    if "deploy/docker/bundle.sh /out" not in build:
        errors.append("build stage does not gather the binaries with deploy/docker/bundle.sh /out")

    final = stage_insts.get("runtime", [])
    users = [r for _, kw, r in final if kw == "USER"]
    if not users or users[-1] != f"{UID}:{UID}":
        errors.append(f"runtime stage must end as USER {UID}:{UID} (numeric, non-root), got {users}")
    copies = [r for _, kw, r in final if kw == "COPY"]
    if "--from=build /out/ /usr/local/" not in copies:
        errors.append("runtime stage does not COPY --from=build /out/ /usr/local/")

    def exec_form(keyword, rest, n):
        try:
            value = json.loads(rest)
        except json.JSONDecodeError:
            value = None
        if not (isinstance(value, list) and all(isinstance(x, str) for x in value)):
            errors.append(f"line {n}: {keyword} is not an exec-form JSON array")
            return []
        return value

    entry = [(n, r) for n, kw, r in final if kw == "ENTRYPOINT"]
    if len(entry) != 1:
        errors.append("runtime stage needs exactly one ENTRYPOINT")
    else:
        argv = exec_form("ENTRYPOINT", entry[0][1], entry[0][0])
        if argv[:1] != ["/usr/local/bin/kvdepotd"] or f"--listen={SOCKET}" not in argv:
            errors.append(f"ENTRYPOINT {argv} does not run /usr/local/bin/kvdepotd --listen={SOCKET}")
    health = [(n, r) for n, kw, r in final if kw == "HEALTHCHECK"]
    if len(health) != 1:
        errors.append("runtime stage needs exactly one HEALTHCHECK")
    else:
        n, rest = health[0]
        m = re.search(r"--timeout=(\d+)s", rest)
        if not m or int(m.group(1)) <= 5:
            errors.append(f"line {n}: HEALTHCHECK --timeout must exceed kvcachectl's 5 s")
        cmd = rest.split("CMD", 1)[1].strip() if "CMD" in rest else ""
        if exec_form("HEALTHCHECK CMD", cmd, n) != PROBE:
            errors.append(f"line {n}: HEALTHCHECK CMD is not {PROBE}")

    if run_dir:
        os.makedirs(run_dir, exist_ok=True)
        for n, body in runs:
            with open(os.path.join(run_dir, f"run_{n}.sh"), "w", encoding="utf-8") as f:
                f.write("#!/bin/sh\n" + body + "\n")

    for e in errors:
        print(f"{dockerfile}: {e}", file=sys.stderr)
    print(f"check_dockerfile: {len(stages)} stages, {len(runs)} RUN, {len(errors)} problems")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
