#!/usr/bin/env bash
# The GPU path in one script, a few minutes on one node: NCCL collectives, a short bf16
# training run on CUDA, the plan against the engine's counters, and the engine benchmark
# against FSDP2 / FSDP1 / DDP with NCCL (TFLOP/s and MFU included).
#
#     bash benchmarks/gpu_check.sh            # results under $OUT (or ./gpu-check-results)
#
# Every step runs even if an earlier one fails; the exit status is the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
FSDPKIT=${FSDPKIT:-.venv/bin/fsdpkit}
RESULTS=${OUT:-./gpu-check-results}
mkdir -p "$RESULTS"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if ! command -v nvidia-smi >/dev/null || ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA GPU visible to torch (torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null))" >&2
    exit 2
fi
GPUS=$(nvidia-smi -L | wc -l)
GPUS=${GPUS:-1}
# The engine benchmark needs at least 2 ranks to shard; with one GPU it runs 1 (a smoke test).
echo "gpu_check: $GPUS GPU(s); results in $RESULTS" >&2
nvidia-smi > "$RESULTS/nvidia-smi.txt" 2>&1
"$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))' > "$RESULTS/torch.txt" 2>&1

failed=0
step() {  # step NAME TIMEOUT_S COMMAND... : stdout to NAME.out, stderr to NAME.err
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout "$limit" "$@" > "$RESULTS/$name.out" 2> "$RESULTS/$name.err"
    local rc=$?
    echo "$name rc=$rc $((SECONDS - started))s" | tee -a "$RESULTS/summary.txt" >&2
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

step allgather_nccl 120 "$FSDPKIT" bench allgather --backend nccl --nproc-per-node "$GPUS" \
    --min-bytes 1M --max-bytes 1G --factor 4 --iters 20 --warmup 5 --dtype bfloat16 --check 1
step allgather_nccl_json 120 "$FSDPKIT" bench all --backend nccl --nproc-per-node "$GPUS" \
    --min-bytes 1M --max-bytes 256M --factor 16 --iters 10 --warmup 3 --check 1 --json
step train_bf16 240 "$FSDPKIT" train --device cuda --mixed-precision bf16 --nproc-per-node "$GPUS" \
    --model gpt-small --steps 50 --global-batch-size $((8 * GPUS)) --seq-len 256 --json
step train_offload_fp32 240 "$FSDPKIT" train --device cuda --nproc-per-node "$GPUS" --cpu-offload \
    --model gpt-tiny --steps 10 --global-batch-size $((4 * GPUS)) --seq-len 128 --json
step plan_gpt2 60 "$FSDPKIT" plan --model gpt2 --world-size "$GPUS" --mixed-precision bf16 --json
step engine_bench_gpt2 420 "$PY" benchmarks/engine.py --backend nccl --nproc-per-node "$GPUS" \
    --model gpt2 --mixed-precision bf16 --batch $((8 * GPUS)) --seq-len 1024 --trials 10 --steps 3 --warmup 3
step engine_bench_gpt2_json 420 "$PY" benchmarks/engine.py --backend nccl --nproc-per-node "$GPUS" \
    --model gpt2 --mixed-precision bf16 --batch $((8 * GPUS)) --seq-len 1024 --trials 5 --steps 3 --warmup 2 --ablation --json

echo "gpu_check: $failed step(s) failed; see $RESULTS/summary.txt" >&2
exit "$failed"
