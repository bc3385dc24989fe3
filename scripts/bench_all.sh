#!/usr/bin/env bash
# Runs every benchmark in scripts/ and prints its JSON figures (docs/benchmarks.md records them).
set -euo pipefail
cd "$(dirname "$0")/.."
shopt -s nullglob
for b in scripts/bench_*.py; do
  echo "== $b"
  python "$b" --json
done
