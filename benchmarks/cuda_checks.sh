#!/usr/bin/env bash
# The CUDA checks of docs/CUDA.md, on a GPU machine as found: its own torch, nothing
# installed, the checkout run with PYTHONPATH=. Every result goes under $OUT (default
# ./cuda-out): the tables, the JSON, the logs, and the calibrated profiles.json, which the
# parts after `calibrate` plan with (the package's own sim/profiles.json is never written).
#
#   bash benchmarks/cuda_checks.sh [PART[:SECONDS] ...]
#
# PART:SECONDS stops that part after SECONDS (timeout, the part counts as failed), so one call
# of the device tool can run every part inside its 10-minute limit. BUNDLE=FILE.tgz packs $OUT
# into one archive after every part: the device tool brings back at most 8 files, and what a
# part left before a stop still comes back.
#
# PARTs, in the order they run by default (each fits the device tool's 10-minute call):
#   env calibrate check-small pytest      (about 3 minutes on an H100)
#   check-medium train adamw check-reduce (about 3 minutes on an H100, 2026-11-26)
#   whole                                 (about 2 minutes on an H200, 2026-11-27: --compile whole at stages 0 and 3, 1 GPU;
#                                          WHOLE_STAGES="0 1 2 3" for every stage, WHOLE_MODES="whole eager" for eager beside,
#                                          WHOLE_FLAGS="--activation-checkpointing full" for more of train's flags,
#                                          WHOLE_MODEL=benchmarks/models/gpt2-30m.json (or -120m): the CPU harness's shapes)
#   ab                                    (on demand, its own call, about 8 minutes for 13 of its 16 runs on an H200, 2026-11-27: AB_STEPS=20 for all; OLD_TREE=DIR: an older commit's trainer beside this one,
#                                          gpt2-small stages 0 and 3, compiled blocks and eager, in turn, twice;
#                                          AB_MODES=--compile or --no-compile: one of the two; the compiled half's 8 runs
#                                          took 29-39 s each on an H200, 2026-11-28)
#   overhead                              (on demand, about 1 minute a tree: the default job's step, eager, stages 0 and 3,
#                                          timed and profiled by cProfile; with OLD_TREE, that tree's first; this
#                                          tree's also compiled; --thread-ab: the tape's autograd on the calling
#                                          thread against the device's worker thread, in turn)
#   peers                                 (on demand, about 5 minutes expected: benchmarks/peers.py on one GPU, one NCCL
#                                          rank each: zerofunc's stages eager and compiled whole beside DDP,
#                                          ZeroRedundancyOptimizer, FSDP2 and DeepSpeed where installed, fp32, 120m
#                                          (PEERS_MODEL), step time and the allocator's peak; PEERS_IMPLS, PEERS_REPEAT)
#   kernels                               (on demand, about 1.5 minutes: the default job's eager step, stages 0-3, one
#                                          step under torch.profiler: the device's busy time against the step's, the
#                                          ops taking the most device and host time; why stages 1-2 ran at half stage 0's pace)
#   lora                                  (on demand, about 2 minutes: --lora 8 at stages 0 and 3, 1 GPU)
#   snapshot                              (on demand: the allocator's blocks at two cells' peaks)
#   whole-memory                          (on demand, about 3 minutes expected: the allocator's blocks at the step's peak,
#                                          eager and compiled whole, stages 0 and 3 (WHOLE_STAGES), one rank, 8 x 128
#                                          tokens: where the step compiled whole holds more than eager, the eighth run's 8-23%;
#                                          WHOLE_MODEL as the whole part's: llama-32k-vocab.json, an untied embedding)
#   titan-memory                          (on demand, 2-4 minutes expected: torchtitan's Llama-3.1-8B H100 rows' shape,
#                                          stage 3 at 8 and 128 simulated ranks, 2 x 8192 tokens, selective-op, fp32
#                                          reductions: planned peak, allocated, and the allocator's peak reserve)
#   fsdp2-memory                          (on demand, 3-5 minutes expected: torchtitan's rows on torch's FSDP2, one rank
#                                          of a fake world of 8 and of 128 on this GPU, Hugging Face's Llama and
#                                          zerofunc's: the allocator's peaks over whole steps, with expandable
#                                          segments as torchtitan's launcher set them, then without)
#   constants                             (on demand, under a minute expected: issue 33's per-op-class constants,
#                                          benchmarks/op_constants.py: GEMM shapes of a Llama-3-8B block, causal
#                                          attention forward and backward, a 1 GiB copy, the kernel floor)
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
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # absolute: part ab runs in another tree
failed=0

LIMIT=0  # seconds a part may run (PART:SECONDS), 0 for no limit

run() {  # run NAME CMD...: CMD's output to $OUT/NAME.txt and to the terminal, its time and status in $OUT/parts.txt
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name: $*" | tee -a "$OUT/parts.txt"
  local left=$((LIMIT - (SECONDS - PART_T0)))
  if [ "$LIMIT" -gt 0 ] && [ "$left" -lt 1 ]; then
    echo "== $name: not run, the part's $LIMIT s are spent" | tee -a "$OUT/parts.txt"; failed=$((failed + 1)); return
  fi
  if [ "$LIMIT" -gt 0 ]; then set -- timeout -k 5 "$left" "$@"; fi
  # In the background, its output through a process substitution, so that the part ends when CMD does:
  # with a pipe to tee the part waited for whatever still held the output. timeout leads a process group
  # of its own (its pid names it), and what is left in it is killed: the seventh run's orphaned rank,
  # which hung the script until the device call's limit.
  "$@" > >(tee "$OUT/$name.txt") 2>&1 &
  local pid=$!
  wait "$pid"
  local code=$?
  if [ "$LIMIT" -gt 0 ]; then kill -KILL -- "-$pid" 2>/dev/null; fi
  echo "== $name: exit $code in $((SECONDS - t0)) s" | tee -a "$OUT/parts.txt"
  [ "$code" -eq 0 ] || failed=$((failed + 1))
}

check() {  # check MODEL: every stage at 1, 8 and 64 simulated ranks, bf16, compile off and then on (CHECK_MODES)
  for compile in ${CHECK_MODES:---no-compile --compile}; do
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
    check-reduce) run check-reduce-fp32 $PY -m zerofunc.check --device cuda --model gpt2-small --precision bf16 \
                    --reduce-dtype fp32 --world-sizes 1,8,64 --no-compile --json-out "$OUT/check-reduce-fp32.json" ;;
    pytest) run pytest $PY -m pytest -m cuda tests/test_cuda.py -q -rs ;;
    train) run train $PY -m train --model gpt2-small --nproc 1 --precision bf16 --steps 50 --out "$OUT/train-gpt2-small"
           run mfu $PY benchmarks/mfu.py "$OUT/train-gpt2-small/metrics.jsonl" --model gpt2-small --seq 128 ;;
    whole) model=${WHOLE_MODEL:-gpt2-small}  # WHOLE_MODEL=benchmarks/models/gpt2-30m.json: the CPU harness's 30m shape
           for stage in ${WHOLE_STAGES:-0 3}; do  # the step compiled whole (funcol on NCCL), beside train's compiled blocks
             for mode in ${WHOLE_MODES:-whole}; do  # WHOLE_MODES="whole eager": each stage eager too, in turn
               flag=$([ "$mode" = eager ] && echo --no-compile || echo --compile whole)
               # WHOLE_FLAGS: more of train's flags for every run (--activation-checkpointing full), named in the label
               name="train-$mode-s$stage$([ "$model" = gpt2-small ] || echo "-$(basename "$model" .json)")"
               name="$name$(printf '%s' "${WHOLE_FLAGS:-}" | tr -cs 'a-z0-9' '-' | sed 's/^-*/-/; s/-*$//')"
               run "$name" $PY -m train --model "$model" --nproc 1 --precision bf16 --steps 50 \
                 --stage "$stage" $flag ${WHOLE_FLAGS:-} --out "$OUT/$name"
               echo "$name: $($PY benchmarks/mfu.py "$OUT/$name/metrics.jsonl" --model "$model" \
                 --seq 128 2>&1 | tail -1)" | tee -a "$OUT/whole.txt"
             done; done ;;
    ab) if [ -z "${OLD_TREE:-}" ] || [ ! -d "$OLD_TREE/train" ]; then  # an older commit's files, beside the checkout's
          echo "ab: set OLD_TREE to a directory holding an older commit's files (git archive COMMIT | tar -x -C DIR)" \
            | tee -a "$OUT/parts.txt"; failed=$((failed + 1)); return; fi
        for round in 1 2; do for mode in ${AB_MODES:---compile --no-compile}; do for stage in 0 3; do for tree in "$OLD_TREE" .; do
          name=ab-$([ "$tree" = . ] && echo new || echo old)-s$stage$mode-$round  # old and new in turn, twice
          run "$name" bash -c "cd '$tree' && PYTHONPATH=. $PY -m train --model ${AB_MODEL:-gpt2-small} --nproc 1 \
            --precision ${AB_PRECISION:-bf16} --steps ${AB_STEPS:-30} --stage $stage $mode --out '$OUT/$name'"
          echo "$name: $($PY benchmarks/mfu.py "$OUT/$name/metrics.jsonl" --model ${AB_MODEL:-gpt2-small} --seq 128 2>&1 \
            | tail -1)" | tee -a "$OUT/ab.txt"
        done; done; done; done ;;
    overhead) for tree in ${OLD_TREE:+"$OLD_TREE"} .; do  # where the launch-bound step's host time goes, per tree (OVERHEAD_STAGES=0,1,2,3)
          name=overhead-$([ "$tree" = . ] && echo new || echo old)
          run "$name" bash -c "cd '$tree' && PYTHONPATH=. $PY '$PWD/benchmarks/step_overhead.py' --device cuda \
            --precision bf16 --width 768 --tokens 8x128 --top 30 --thread-ab --stages ${OVERHEAD_STAGES:-0,3}"
        done
        run overhead-new-compile $PY benchmarks/step_overhead.py --device cuda --precision bf16 --width 768 \
          --tokens 8x128 --compile --thread-ab --stages "${OVERHEAD_STAGES:-0,3}" ;;
    peers) run "peers-${PEERS_MODEL:-120m}" $PY benchmarks/peers.py --device cuda --model "${PEERS_MODEL:-120m}" \
             --repeat "${PEERS_REPEAT:-1}" --json --impl ${PEERS_IMPLS:-zerofunc-0 zerofunc-1 zerofunc-2 zerofunc-3 \
             zerofunc-whole-0 zerofunc-whole-1 zerofunc-whole-2 zerofunc-whole-3 ddp zero-redundancy-opt \
             fsdp2-reshard-false fsdp2-reshard-true deepspeed-0 deepspeed-1 deepspeed-2 deepspeed-3} ;;
    kernels) run kernels $PY benchmarks/step_overhead.py --device cuda --precision bf16 --width 768 --tokens 8x128 \
               --kernels 25 --stages "${OVERHEAD_STAGES:-0,1,2,3}" ;;  # where the eager step's device time goes
    lora) for stage in 0 3; do  # LoRA r=8 on a frozen bf16 base (issue 32), compiled blocks, 1 GPU
            run lora-s$stage $PY -m train --model gpt2-small --nproc 1 --precision bf16 --steps 50 --stage $stage \
              --lora 8 --out "$OUT/lora-s$stage"
            echo "lora-s$stage: $($PY benchmarks/mfu.py "$OUT/lora-s$stage/metrics.jsonl" --model gpt2-small --seq 128 2>&1 \
              | tail -1)" | tee -a "$OUT/lora.txt"
          done ;;
    snapshot) for cell in "0 1" "3 64"; do set -- $cell
           run "snapshot-s$1-w$2" $PY benchmarks/cuda_memory_snapshot.py --model gpt2-small --stage "$1" --world-size "$2"; done ;;
    whole-memory) model=${WHOLE_MODEL:-gpt2-small}  # the whole part's shape, one rank (and its WHOLE_MODEL)
           for stage in ${WHOLE_STAGES:-0 3}; do for mode in no whole; do
           run "whole-memory-s$stage-$mode$([ "$model" = gpt2-small ] || echo "-$(basename "$model" .json)")" \
             $PY benchmarks/cuda_memory_snapshot.py --model "$model" --stage "$stage" \
             --world-size 1 --micro-batch 8 --seq 128 --compile "$mode"; done; done ;;
    constants) run constants $PY benchmarks/op_constants.py --json-out "$OUT/op-constants.json" \
                 --profiles-out "$OUT/measured-profiles.json" ;;
    titan-memory) run titan-memory $PY -m zerofunc.check --device cuda --model llama3-8b --precision bf16 \
                    --reduce-dtype fp32 --stage 3 --world-sizes 8,128 --micro-batch 2 --seq 8192 \
                    --activation-checkpointing selective-op --no-compile --steps 2 --json-out "$OUT/titan-memory.json" ;;
    fsdp2-memory) run fsdp2-memory-expandable env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
                    $PY benchmarks/fsdp2_memory.py --device cuda --json-out "$OUT/fsdp2-memory-expandable.json"
                  run fsdp2-memory-default env -u PYTORCH_CUDA_ALLOC_CONF \
                    $PY benchmarks/fsdp2_memory.py --device cuda --no-plan --json-out "$OUT/fsdp2-memory-default.json" ;;
    adamw) run adamw-fp32 $PY benchmarks/fused_adamw.py
           run adamw-bf16 $PY benchmarks/fused_adamw.py --grad-dtype bf16 ;;
    *) echo "unknown part $1"; failed=$((failed + 1)) ;;
  esac
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(env calibrate check-small pytest check-medium train adamw check-reduce whole)
for p in "${parts[@]}"; do
  LIMIT=0; name=$p
  if [[ $p == *:* ]]; then name=${p%%:*}; LIMIT=${p#*:}; fi
  PART_T0=$SECONDS
  part "$name"
  if [ -n "${BUNDLE:-}" ]; then tar czf "$BUNDLE.tmp" -C "$(dirname "$OUT")" "$(basename "$OUT")" && mv "$BUNDLE.tmp" "$BUNDLE"; fi
done
echo "failed parts: $failed" | tee -a "$OUT/parts.txt"
if [ -n "${BUNDLE:-}" ]; then tar czf "$BUNDLE" -C "$(dirname "$OUT")" "$(basename "$OUT")"; fi
exit "$failed"
