#!/usr/bin/env bash
# The CUDA checks of docs/CUDA.md, on a GPU machine as found: its own torch, nothing
# installed, the checkout run with PYTHONPATH=. Every result goes under $OUT (default
# ./cuda-out): the tables, the JSON, the logs, and the calibrated profiles.json, which the
# parts after `calibrate` plan with (the package's own sim/profiles.json is never written).
#
#   bash benchmarks/cuda_checks.sh [PART ...]
#
# PARTs, in the order they run by default (each fits the device tool's 10-minute call):
#   env calibrate check-small pytest      (about 5 minutes)
#   check-medium train adamw              (about 6 minutes)
# A part that fails is reported and the next one still runs; the exit code is the
# number of failed parts.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
OUT=${OUT:-cuda-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export ZEROFUNC_PROFILES="$OUT/profiles.json"  # what calibrate records, every later part reads
PY=${PYTHON:-python}
failed=0

run() {  # run NAME CMD...: CMD's output to $OUT/NAME.txt and to the terminal, its time and status in $OUT/parts.txt
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name: $*" | tee -a "$OUT/parts.txt"
  "$@" 2>&1 | tee "$OUT/$name.txt"
  local code=${PIPESTATUS[0]}
  echo "== $name: exit $code in $((SECONDS - t0)) s" | tee -a "$OUT/parts.txt"
  [ "$code" -eq 0 ] || failed=$((failed + 1))
}

check() {  # check MODEL: every stage at 1, 8 and 64 simulated ranks, bf16, compile off and then on
  for compile in --no-compile --compile; do
    run "check-$1$compile" $PY -m zerofunc.check --device cuda --model "$1" --precision bf16 \
      --world-sizes 1,8,64 $compile --json-out "$OUT/check-$1$compile.json"
  done
}

part() {
  case $1 in
    env) run env $PY -c "import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda,
torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)"
         nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 ;;
    calibrate) run calibrate $PY -m zerofunc.check --calibrate ;;
    check-small) check gpt2-small ;;
    check-medium) check gpt2-medium ;;
    pytest) run pytest $PY -m pytest -m cuda tests/test_cuda.py -q -rs ;;
    train) run train $PY -m train --model gpt2-small --nproc 1 --precision bf16 --steps 50 --out "$OUT/train-gpt2-small"
           run mfu $PY benchmarks/mfu.py "$OUT/train-gpt2-small/metrics.jsonl" --model gpt2-small --seq 128 ;;
    adamw) run adamw-fp32 $PY benchmarks/fused_adamw.py
           run adamw-bf16 $PY benchmarks/fused_adamw.py --grad-dtype bf16 ;;
    *) echo "unknown part $1"; failed=$((failed + 1)) ;;
  esac
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(env calibrate check-small pytest check-medium train adamw)
for p in "${parts[@]}"; do part "$p"; done
echo "failed parts: $failed" | tee -a "$OUT/parts.txt"
exit "$failed"
