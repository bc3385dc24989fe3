#!/usr/bin/env bash
# The first run of hspmd on an NVIDIA GPU machine, in one go (< 8 minutes): training on CUDA against the CPU
# reference first, then numerics, the GPU's profile against its spec profile, simulated vs measured.
#
#   bash scripts/gpu_check.sh [--out DIR] [--python PY] [--wheels DIR]   # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run [--out DIR] [--python PY] [--wheels DIR]   # the same on the CPU
#
# No network is needed. The interpreter is the first of --python PY, ./.venv/bin/python, python3 that
# imports torch (the machine's own torch is used as it is: no venv is created over it). What else the check
# imports (pyyaml, click, rich, safetensors, tokenizers, pulp, highspy) and the interpreter lacks is
# installed from DIR (default ./wheels, filled beforehand by `make wheels`) with `pip --no-index` into
# OUT/pydeps, which only this run puts on its path. Phases that need a package neither has are skipped and
# say so. Install time is not charged to the phases' budget.
#
# Writes OUT/summary.json (default OUT: gpu-check-out/): one entry per phase (ok / failed / skipped, with the
# reason), what was and was not exercised, and the generated cluster, model, plans, profiles and metrics.
# Exit status: 0 when every phase that ran succeeded (and every training run matched), 1 otherwise.
set -u
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$REPO/gpu-check-out"
WHEELS="$REPO/wheels"
PY=""
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --dry-run) PASS+=("--dry-run"); shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
MODE="$([ ${#PASS[@]} -gt 0 ] && echo dry-run || echo gpu)"

fail_without_python() {
  # Nothing below can run: still leave one summary that says why (JSON-escaped by hand: no python here).
  local reason="${1//\\/\\\\}"; reason="${reason//\"/\\\"}"
  printf '{\n  "mode": "%s",\n  "ok": false,\n  "phases": {"install": {"status": "failed", "reason": "%s"}}\n}\n' \
    "$MODE" "$reason" >"$OUT/summary.json"
  echo "[gpu_check] install: failed ($1); summary: $OUT/summary.json" >&2
  exit 1
}

# 1. The interpreter: chosen by what it imports, never by where it is.
CANDIDATES=()
if [ -n "$PY" ]; then CANDIDATES=("$PY"); else CANDIDATES=("$REPO/.venv/bin/python" python3 python); fi
TRIED=""
for c in "${CANDIDATES[@]}"; do
  if command -v "$c" >/dev/null 2>&1 && "$c" -c "import torch" >/dev/null 2>&1; then PY="$(command -v "$c")"; break; fi
  TRIED="$TRIED $c"
  PY=""
done
[ -n "$PY" ] || fail_without_python "no interpreter imports torch (tried:$TRIED)"

# 2. The packages the check imports besides torch: missing ones from the local wheel folder, offline.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
NEEDED="yaml:pyyaml click:click rich:rich safetensors:safetensors tokenizers:tokenizers pulp:pulp highspy:highspy"
missing() {
  "$PY" - "$@" <<'EOF'
import importlib.util, sys
print(" ".join(p.split(":")[1] for p in sys.argv[1:] if importlib.util.find_spec(p.split(":")[0]) is None))
EOF
}
MISSING="$(missing $NEEDED)"
INSTALL_STATUS=ok
INSTALL_REASON="interpreter $PY ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
INSTALL_START=$SECONDS
if [ -n "$MISSING" ]; then
  if [ -d "$WHEELS" ] && "$PY" -m pip --version >/dev/null 2>&1; then
    # Into a folder of this run's own, never into the interpreter's environment; --no-deps is not used: the
    # wheel folder holds the dependencies too, and nothing here depends on torch, so torch is never touched.
    if timeout 50 "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" --target "$OUT/pydeps" \
        --upgrade $MISSING >"$OUT/install.log" 2>&1; then
      INSTALL_REASON="$INSTALL_REASON; installed offline from $WHEELS into $OUT/pydeps: $MISSING"
    else
      INSTALL_STATUS=partial
      INSTALL_REASON="$INSTALL_REASON; pip --no-index from $WHEELS failed for some of: $MISSING (see $OUT/install.log)"
    fi
    # PYTHONPATH comes before the interpreter's site-packages: drop what it already has (numpy, pulled in by
    # highspy, say), so that only the missing packages are taken from here and nothing of the machine's hidden.
    "$PY" - "$OUT/pydeps" <<'EOF' >>"$OUT/install.log" 2>&1
import importlib.util, pathlib, shutil, sys
for entry in sorted(pathlib.Path(sys.argv[1]).glob("*")):
    name = entry.stem if entry.suffix in (".py", ".so") else entry.name
    if name.isidentifier() and importlib.util.find_spec(name) is not None:
        print(f"kept the interpreter's {name}")
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
EOF
    export PYTHONPATH="$PYTHONPATH:$OUT/pydeps"
  else
    INSTALL_STATUS=partial
    INSTALL_REASON="$INSTALL_REASON; missing $MISSING and no wheel folder $WHEELS (make wheels) or no pip"
  fi
  STILL="$(missing $NEEDED)"
  [ -n "$STILL" ] && INSTALL_REASON="$INSTALL_REASON; still missing: $STILL"
else
  INSTALL_REASON="$INSTALL_REASON; every package the check imports is there"
fi
INSTALL_S=$((SECONDS - INSTALL_START))
"$PY" -c "import torch, yaml, click" >/dev/null 2>&1 || \
  fail_without_python "$PY cannot import torch, yaml and click ($INSTALL_REASON)"

exec "$PY" "$REPO/scripts/gpu_check.py" "${PASS[@]}" --out "$OUT" --python "$PY" \
  --install-status "$INSTALL_STATUS" --install-reason "$INSTALL_REASON" --install-s "$INSTALL_S"
