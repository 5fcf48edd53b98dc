#!/usr/bin/env bash
# client/python's unittest runner (fails on 0 tests) with this folder on
# PYTHONPATH; Debian's /usr/bin/python3 with python3-torch.
set -euo pipefail
root="$(pwd)"
export PYTHONPATH="$root/examples/ref_worker${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$root/client/python/tests/run_unittest.sh" "$@"
