#!/usr/bin/env bash
# The first run of hspmd on an NVIDIA GPU machine, in one go (< 5 minutes): install, profile the GPU,
# train a small Llama in bf16 on NCCL, compare with the CPU fp32 reference, MFU, simulated vs measured.
#
#   bash scripts/gpu_check.sh [--out DIR] [--python PY]   # on the GPU machine (DIR: gpu-check-out/)
#   bash scripts/gpu_check.sh --dry-run [--out DIR] [--python PY]   # the same pipeline on the CPU (CI)
#
# Writes DIR/summary.json: one entry per phase (ok / failed / skipped, with the reason), and the generated
# cluster, model, plans, profiles and metrics beside it. A failing phase never stops the others.
# Exit status: 0 when every phase that ran succeeded (and every training run matched), 1 otherwise.
set -u
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$REPO/gpu-check-out"
PY=""
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --dry-run) PASS+=("--dry-run"); shift ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"

# Install: the project's own venv (make install keeps a torch that is already importable, e.g. the CUDA
# build on a GPU machine). With --python, that interpreter is used as it is.
INSTALL_STATUS=ok
INSTALL_REASON=""
if [ -z "$PY" ]; then
  if command -v make >/dev/null 2>&1 && command -v python3 >/dev/null 2>&1; then
    if (cd "$REPO" && timeout 240 make install) >"$OUT/install.log" 2>&1; then
      PY="$REPO/.venv/bin/python"
      INSTALL_REASON="make install (log: $OUT/install.log)"
    else
      INSTALL_STATUS=failed
      INSTALL_REASON="make install failed or ran past 240 s: see $OUT/install.log"
    fi
  else
    INSTALL_STATUS=failed
    INSTALL_REASON="make or python3 missing"
  fi
  if [ "$INSTALL_STATUS" = failed ]; then
    # E.g. no network for pip: go on with an existing venv, else python3, importing hspmd from this
    # checkout; the summary says which dependencies are missing and the phases what that breaks.
    if [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; else PY="$(command -v python3 || echo python3)"; fi
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
    MISSING="$("$PY" -c 'import importlib.util as u; print(" ".join(m for m in ("torch", "yaml", "click", "rich", "pulp", "highspy", "safetensors") if u.find_spec(m) is None))' 2>/dev/null || echo "$PY does not run")"
    INSTALL_REASON="$INSTALL_REASON; using $PY${MISSING:+, missing: $MISSING}"
  fi
else
  INSTALL_REASON="kept: --python $PY"
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi

if ! "$PY" -c "import torch, yaml, click" >/dev/null 2>&1; then
  # Nothing below can run: still leave one summary that says why (JSON-escaped by hand: no python here).
  INSTALL_REASON="${INSTALL_REASON//\\/\\\\}"; INSTALL_REASON="${INSTALL_REASON//\"/\\\"}"
  printf '{\n  "mode": "%s",\n  "ok": false,\n  "phases": {"install": {"status": "failed", "reason": "%s cannot import torch, yaml and click (%s)"}}\n}\n' \
    "$([ ${#PASS[@]} -gt 0 ] && echo dry-run || echo gpu)" "$PY" "$INSTALL_REASON" >"$OUT/summary.json"
  echo "[gpu_check] install: failed; summary: $OUT/summary.json" >&2
  exit 1
fi

# What installing left of the 5 minutes (at least 60 s, so that a slow install still gets a check).
BUDGET=$((290 - SECONDS)); [ "$BUDGET" -lt 60 ] && BUDGET=60
exec "$PY" "$REPO/scripts/gpu_check.py" "${PASS[@]}" --out "$OUT" --python "$PY" --budget-s "$BUDGET" \
  --install-status "$INSTALL_STATUS" --install-reason "$INSTALL_REASON"
