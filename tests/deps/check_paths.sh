#!/usr/bin/env bash
# check_paths.sh PATHS_FILE FROM TO MODE: PATHS_FILE is a genquery's output
# (targets on dependency paths from FROM's libraries to TO). MODE
# expect_none: it must be empty; expect_violation: it must name a target of
# FROM and one of each TO (the self-test of the query).
set -euo pipefail
paths="$1" from="$2" to="$3" mode="$4"
[[ -f "$paths" ]] || { echo "FAIL: no genquery output $paths" >&2; exit 1; }
if [[ "$mode" == expect_none ]]; then
  if [[ -s "$paths" ]]; then
    echo "FAIL: libraries under $from depend on $to (testonly targets may;" >&2
    echo "shipped libraries may not: docs/ARCHITECTURE.md). Targets on the" >&2
    echo "offending paths:" >&2
    sed 's/^/  /' "$paths" >&2
    exit 1
  fi
  echo "ok: no library under $from depends on $to"
  exit 0
fi
grep -q "^${from%:}[/:]" "$paths" || { echo "FAIL: self-test found no $from target" >&2; cat "$paths" >&2; exit 1; }
IFS=, read -ra tos <<<"$to"
for t in "${tos[@]}"; do
  grep -q "^$t[/:]" "$paths" || { echo "FAIL: self-test found no $t target" >&2; cat "$paths" >&2; exit 1; }
done
echo "ok: the query reports the fixture's forbidden edge:"
cat "$paths"
