#!/usr/bin/env bash
# The hspmd story on the built-in emulated CPU cluster (cpu-hetero4). Each capability adds its act.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${DEMO_OUT:-demo-out}
mkdir -p "$OUT"

act() { printf '\n\033[1m== %s ==\033[0m\n' "$*"; }

act "1. The formats: a hand-written heterogeneous plan for llama-tiny on cpu-hetero4"
hspmd validate configs/plans/cpu-hetero4-tiny.yaml
hspmd show configs/plans/cpu-hetero4-tiny.yaml

act "   ... and a broken plan is refused with one line per problem (exit 2)"
cat > "$OUT/broken-plan.yaml" <<'YAML'
version: 1
model: llama-tiny
cluster: cpu-hetero4
training: {global_batch: 8, micro_batch: 1, seq_len: 64}
strategies:
- name: broken
  pipelines:
  - micro_batches: 8
    stages:
    - {devices: [0, 2], layers: [0, 4]}
    - {devices: [7], layers: [3, 6]}
YAML
if hspmd validate "$OUT/broken-plan.yaml"; then echo "expected a failure" >&2; exit 1; fi

act "Not yet in this build: profile, plan, train, replan (see README 'Status')"
