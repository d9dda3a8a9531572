#!/usr/bin/env bash
# The GPU sweep: correctness, then the benchmarks, each step under its own time limit, in order.
#
#   bash benchmarks/gpu_sweep.sh OUT_DIR [quick|full] [STEPS]
#
# STEPS: comma-separated subset of validate,bench,new_primitives,train (default: all, in that
# order), so that a sweep can be split over several shorter sessions on the machine.
# Run from the repository root. The project is imported with PYTHONPATH=. ; FlashAttention-4 (and
# Flex's FLASH backend) is used when importable, e.g. after `source .peers/install_fa4.sh`, and is
# reported as "n/a (not installed)" otherwise. A step that fails or runs out of time is recorded
# in OUT_DIR/sweep_status.tsv and the next step runs; each step writes its JSON (and log) into
# OUT_DIR as it goes, so a step stopped by its limit keeps what finished.
#
# quick: step limits 3 + 6 + 3.5 + 5 minutes (validate --quick; bench's default grid; new
#        primitives at 16K; training throughput at 16K and 64K).
# full:  every shape of bench.py (16K/64K, d 64/128, MHA/GQA), the full validation, training at
#        16K-128K; step limits 25 + 40 + 15 + 20 minutes.
# Limits (seconds) can be changed with T_VALIDATE, T_BENCH, T_NEWPRIM, T_TRAIN.
set -u
if [ $# -lt 1 ]; then
  echo "usage: bash benchmarks/gpu_sweep.sh OUT_DIR [quick|full] [validate,bench,new_primitives,train]" >&2
  exit 2
fi
OUT=$1
MODE=${2:-quick}
STEPS=${3:-validate,bench,new_primitives,train}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
STATUS="$OUT/sweep_status.tsv"
[ -f "$STATUS" ] || printf "step\trc\tseconds\tlimit\tcommand\n" > "$STATUS"

case "$MODE" in
  quick)
    : "${T_VALIDATE:=180}" "${T_BENCH:=360}" "${T_NEWPRIM:=210}" "${T_TRAIN:=300}"
    VALIDATE_ARGS=(--quick)
    BENCH_ARGS=(--deadline $((T_BENCH - 45)))
    NEWPRIM_ARGS=(--deadline $((T_NEWPRIM - 40)))
    TRAIN_ARGS=(throughput --seq-len 16384,65536 --steps 6 --deadline $((T_TRAIN - 30)))
    ;;
  full)
    : "${T_VALIDATE:=1500}" "${T_BENCH:=2400}" "${T_NEWPRIM:=900}" "${T_TRAIN:=1200}"
    VALIDATE_ARGS=()
    BENCH_ARGS=(--full --deadline $((T_BENCH - 120)))
    NEWPRIM_ARGS=(--deadline $((T_NEWPRIM - 60)))
    TRAIN_ARGS=(throughput --deadline $((T_TRAIN - 60)))
    ;;
  *)
    echo "mode must be quick or full, got '$MODE'" >&2
    exit 2
    ;;
esac

run_step() {  # name limit command...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s): $*" | tee -a "$OUT/sweep.log"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=30 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local dt=$((SECONDS - t0))
  [ $rc -eq 124 ] && echo "   $name: stopped at its time limit" | tee -a "$OUT/sweep.log"
  echo "   $name: exit $rc after ${dt} s (log $OUT/$name.log)" | tee -a "$OUT/sweep.log"
  printf "%s\t%s\t%s\t%s\t%s\n" "$name" "$rc" "$dt" "$limit" "$*" >> "$STATUS"
  tail -n 5 "$OUT/$name.log" | sed 's/^/   | /'
}

want() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

"$PY" - <<'EOF' | tee -a "$OUT/sweep.log"
import torch
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device",
      "| torch", torch.__version__)
try:
    import flash_attn.cute  # noqa: F401
    print("FlashAttention-4: importable")
except Exception as e:  # noqa: BLE001
    print("FlashAttention-4: n/a (not installed):", type(e).__name__)
EOF

if want validate; then
  run_step validate "$T_VALIDATE" "$PY" benchmarks/validate_gpu.py --out "$OUT" "${VALIDATE_ARGS[@]}"
fi
if want bench; then
  run_step bench "$T_BENCH" "$PY" benchmarks/bench.py --out "$OUT" "${BENCH_ARGS[@]}"
fi
if want new_primitives; then
  run_step new_primitives "$T_NEWPRIM" "$PY" benchmarks/new_primitives_gpu.py --out "$OUT" "${NEWPRIM_ARGS[@]}"
fi
if want train; then
  run_step train "$T_TRAIN" "$PY" benchmarks/train_long_context.py "${TRAIN_ARGS[@]}" --out "$OUT"
fi
echo "done: $STATUS" | tee -a "$OUT/sweep.log"
column -t -s "$(printf '\t')" "$STATUS" 2>/dev/null || cat "$STATUS"
