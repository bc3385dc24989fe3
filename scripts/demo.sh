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

act "2. Train: every device runs its own program (fast devices: whole model, 3 micro-batches each; slow pair: a 2-stage pipeline, 2)"
echo "devices 2 and 3 emulate a 3x slower chip: each compute block is followed by a sleep of 2x its compute time"
rm -rf "$OUT/checkpoint"
hspmd train --plan configs/plans/cpu-hetero4-dp-pp.yaml --strategy dp-pp --steps 30 \
  --metrics "$OUT/train-metrics.jsonl" --trace "$OUT/trace" --save "$OUT/checkpoint"
echo "last metrics line: $(tail -n 1 "$OUT/train-metrics.jsonl")"

act "   ... and the checkpoint (full tensors by name) continues under the TP-2 + pipeline plan of act 1"
hspmd train --plan configs/plans/cpu-hetero4-tiny.yaml --load "$OUT/checkpoint" --steps 10 \
  --metrics "$OUT/train-metrics-continued.jsonl"

act "Not yet in this build: profile, plan, replan (see README 'Status')"
