#!/usr/bin/env bash
# The GPU check (docs/gpu.md), from the repository root:
#     bash tests/gpu/run.sh OUT             on a CUDA machine without a network: install ftsup offline (the wheels
#                                           tests/gpu/fetch_wheels.sh put in .whl/), the CUDA tests, the rows at 1, 12
#                                           and 24 GB of state
#     bash tests/gpu/run.sh --dry-run OUT   the same script on a CPU: tiny states, nothing installed, CUDA skipped
# OUT/table.md and OUT/results.json are written again after every stage, so a run stopped at its limit still leaves
# a table; OUT/check.log holds everything. Each stage has a time limit; one that fails is recorded and the next one
# runs; the whole ends within FTSUP_GPU_BUDGET_S seconds (470; 150 for a dry run).
set -uo pipefail

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
if [ $# -ne 1 ]; then echo "usage: bash tests/gpu/run.sh [--dry-run] OUT" >&2; exit 2; fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 2
mkdir -p "$1" && OUT=$(cd "$1" && pwd) || exit 2
export PY=${PYTHON:-python3} REPO OUT
START=$(date +%s)
if [ $DRY = 1 ]; then BUDGET=${FTSUP_GPU_BUDGET_S:-150}; else BUDGET=${FTSUP_GPU_BUDGET_S:-470}; fi
DEADLINE=$((START + BUDGET))
LOG="$OUT/check.log"
NOTES=$(mktemp -d)
CKPT_NAME=ftsup-gpu-check-$$
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
export PYTHONPATH=/tmp/ftsup-site${PYTHONPATH:+:$PYTHONPATH}  # the wheels, where the interpreter's own is read-only
FAILED=0

say() { echo "[gpu-check $(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
report() { "$PY" -m ftsup.tools.bench.gpu.report "$@" >>"$LOG" 2>&1 || say "the report could not be written ($1)"; }
left() { echo $((DEADLINE - $(date +%s))); }
cleanup() { rm -rf "$NOTES" /dev/shm/"$CKPT_NAME" /tmp/"$CKPT_NAME"; }
trap cleanup EXIT

# stage NAME LIMIT_S COMMAND...: COMMAND under `timeout`, within the time left; how it ended goes to the report, with
# the last line of $NOTES/NAME as its note when the command wrote one.
stage() {
    local name=$1 limit=$2 t0 rc status note
    shift 2
    if [ "$limit" -gt $(($(left) - 5)) ]; then limit=$(($(left) - 5)); fi
    if [ "$limit" -lt 15 ]; then
        say "$name: skipped, out of time"
        report stage "$OUT" "$name" skipped 0 "out of time"
        return 1
    fi
    say "$name: started (limit ${limit}s)"
    t0=$(date +%s)
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$LOG" "$NOTES/$name.log"
    rc=${PIPESTATUS[0]}
    case $rc in 0) status=ok ;; 124 | 137) status=timeout ;; *) status=failed ;; esac
    if [ "$rc" != 0 ]; then FAILED=1; fi
    note="exit $rc"
    if [ -s "$NOTES/$name" ]; then
        note="$(tail -n 1 "$NOTES/$name") (exit $rc)"
    elif [ "$rc" != 0 ]; then  # the last thing it said, an exception's last line most often
        note="exit $rc: $(grep -v '^[[:space:]]*$' "$NOTES/$name.log" | tail -n 1)"
    fi
    report stage "$OUT" "$name" "$status" $(($(date +%s) - t0)) "$note"
    say "$name: $status (exit $rc)"
    return "$rc"
}

install_offline() {  # $1: the note file
    set -e
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl \
            || "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/ftsup-site .whl/*.whl
    fi
    if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .; then
        echo "pip install -e . failed: the C extension is built in place and the packages linked under ftsup/"
        "$PY" setup.py -q build_ext --inplace || true
        ln -sfn ../supervisor ftsup/supervisor
        ln -sfn ../trainer ftsup/trainer
    fi
    check_install "$1"
}

check_install() {  # $1: the note file
    "$PY" - "$1" <<'EOF'
import sys

import structlog  # noqa: F401  (ftsup's one dependency the machine lacks)
import torch

import ftsup.trainer.checkpoint  # noqa: F401
from ftsup.store import blocksum

impl = blocksum.implementation()
cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
with open(sys.argv[1], "w") as f:
    f.write(f"checksums: {impl}; torch {torch.__version__}; {cuda}\n")
if impl == "python":
    print("!" * 100 + "\nTHE C EXTENSION ftsup.store._blocksum IS NOT BUILT: checksums run in pure Python, far too slow "
          "for GB of state; the rows are sized down to 0.25 GB\n" + "!" * 100)
EOF
}

cuda_tests() {  # $1: the note file
    "$PY" -m pytest -m gpu -q -rfE -p no:cacheprovider tests/gpu 2>&1 | tee "$1.out"
    local rc=${PIPESTATUS[0]}
    grep -E "[0-9]+ (passed|failed|skipped|error)" "$1.out" | tail -n 1 >"$1"
    return "$rc"
}

room() {  # bytes free under $1, or 0
    local free
    free=$(df -B1 --output=avail "$1" 2>/dev/null | tail -n 1 | tr -d ' ')
    echo "${free:-0}"
}

export -f install_offline check_install cuda_tests

: >"$OUT/stages.jsonl"
: >"$OUT/rows.jsonl"
: >"$LOG"
MODE=real
if [ $DRY = 1 ]; then MODE=dry-run; fi
GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
report meta "$OUT" "mode=$MODE" "date=$(date -u +%Y-%m-%dT%H:%MZ)" "gpu=${GPU:-}" "cpus=$(nproc)" \
    "memory_gib=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1048576))" "budget_s=$BUDGET"
say "mode $MODE, budget ${BUDGET}s, gpu: ${GPU:-none}"
{ free -g; df -h /dev/shm /tmp "$REPO"; } >>"$LOG" 2>&1

if [ $DRY = 1 ]; then
    stage install 60 bash -c 'check_install "$0"' "$NOTES/install"
    SIZES=("1GB:0.004" "12GB:0.008" "24GB:0.016")
    ROW_ARGS=(--device cpu --d 64 --tokens 64 --repeats 1 --threads 1)
else
    stage install 150 bash -c 'install_offline "$0"' "$NOTES/install"
    SIZES=("1GB:1" "12GB:12" "24GB:24")
    ROW_ARGS=(--device cuda)
    if grep -q "checksums: python" "$NOTES/install" 2>/dev/null; then SIZES=("0.25GB:0.25"); fi
fi
stage cuda-tests 200 bash -c 'cuda_tests "$0"' "$NOTES/cuda-tests"

for i in "${!SIZES[@]}"; do
    label=${SIZES[$i]%%:*}
    gb=${SIZES[$i]##*:}
    if [ $DRY = 1 ]; then
        want=40 margin=5 root=$NOTES
    else
        case $i in 0) want=70 ;; 1) want=$((($(left) - 10) * 45 / 100)) ;; *) want=$(($(left) - 5)) ;; esac
        margin=30
        need=$(awk -v g="$gb" 'BEGIN {printf "%d", g * 1.15e9 + 2e9}')
        root=${FTSUP_GPU_CKPT_ROOT:-}
        if [ -z "$root" ]; then
            for candidate in /dev/shm /tmp; do
                if [ "$(room "$candidate")" -gt "$need" ]; then root=$candidate && break; fi
            done
        fi
        if [ -z "$root" ]; then
            say "rows $label: skipped, neither /dev/shm nor /tmp has $need bytes free"
            report stage "$OUT" "rows-$label" skipped 0 "no room for $need bytes in /dev/shm or /tmp"
            continue
        fi
    fi
    limit=$want
    if [ "$limit" -gt $(($(left) - 5)) ]; then limit=$(($(left) - 5)); fi
    stage "rows-$label" "$limit" "$PY" -m ftsup.tools.bench.gpu.rows --gb "$gb" --label "$label" \
        --dir "$root/$CKPT_NAME/$label" --out "$OUT/rows.jsonl" --deadline $(($(date +%s) + limit - margin)) \
        "${ROW_ARGS[@]}"
    rm -rf "${root:?}/$CKPT_NAME"
done

report render "$OUT"
say "done in $(($(date +%s) - START))s: $OUT/table.md, $OUT/results.json, $OUT/check.log"
cat "$OUT/table.md"
exit $FAILED
