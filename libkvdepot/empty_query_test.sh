#!/usr/bin/env bash
# Passes when the genquery output $1 is empty (no forbidden path).
set -euo pipefail
if [ -s "$1" ]; then
  echo "forbidden dependency paths from //libkvdepot:" >&2
  cat "$1" >&2
  exit 1
fi
echo "no path from //libkvdepot to //server or //client"
