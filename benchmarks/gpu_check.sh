#!/usr/bin/env bash
# The GPU checks in at most 9 minutes on one GPU; one JSON document and a table of what they measure.
#
#     bash benchmarks/gpu_check.sh                      # results under $OUT (or ./gpu-check-results)
#     GPU_CHECK_DRY_RUN=1 bash benchmarks/gpu_check.sh  # print each part's command, run nothing
#
# Parts, each under its own time limit (together 505 s); one that fails or runs out of time is
# recorded with its error and the others still run:
#   compat_*     gpt-small bf16: 40 steps straight; 20 steps saved, resumed to 40: losses bitwise equal
#   engine       benchmarks/engine.py, gpt2-xl bf16, 8 x 1024: fsdpkit, FSDP2 and DDP (step, TFLOP/s, MFU, peak)
#   plain, snapshot, async_save   gpt2-large bf16, 100 steps of 8 x 1024: plain, with --max-restarts 1
#                --snapshot-every 10, with --async-save --save-every 10 (elapsed and tokens/s against plain)
#   compile      the plain run with --compile, 30 steps (tokens/s leaves the compiling first step out)
#   snapshot_check  benchmarks/snapshot_check.py: an async save and an in-memory snapshot copied to the host
#                while the next steps run on the GPU hold the step they name, bitwise
#   plan         plan --time of the engine's configuration on the GPU's built-in profile
# benchmarks/plan_gpu_check.py gathers them into gpu-check.json and gpu-check.md (printed), the
# plan against the engine's measured step included. The exit status is the number of failed parts.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
FSDPKIT=${FSDPKIT:-.venv/bin/fsdpkit}
RESULTS=${OUT:-./gpu-check-results}
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

part() {  # part NAME LIMIT_S COMMAND...: stdout to NAME.out, stderr to NAME.err, "NAME rc seconds" to parts.tsv
    local name=$1 limit=$2
    shift 2
    if [ "$DRY_RUN" = 1 ]; then
        printf '%s\t%s\n' "$name" "${*@Q}"
        return 0
    fi
    local started=$SECONDS
    timeout "$limit" "$@" > "$RESULTS/$name.out" 2> "$RESULTS/$name.err"
    local rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - started))" >> "$RESULTS/parts.tsv"
    echo "gpu_check: $name rc=$rc $((SECONDS - started))s" >&2
}

profile_of() {  # the built-in hardware profile of a GPU's name
    case "$1" in
        *H200*) echo h200-ib400 ;;
        *A100*80GB*) echo a100-80gb-ib400 ;;
        *A100*) echo a100-40gb-ib400 ;;
        *) echo h100-ib400 ;;
    esac
}

if [ "$DRY_RUN" = 1 ]; then
    GPU_NAME="NVIDIA H200"
else
    if ! command -v nvidia-smi >/dev/null || ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        echo "gpu_check: no CUDA GPU visible to torch (torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null))" >&2
        exit 2
    fi
    mkdir -p "$RESULTS"
    rm -f "$RESULTS/parts.tsv"
    GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
    "$PY" -c 'import json, torch; print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0)}))' \
        > "$RESULTS/device.json"
fi
PROFILE=$(profile_of "$GPU_NAME")
echo "gpu_check: $GPU_NAME (profile $PROFILE); results in $RESULTS" >&2

ONE_GPU=(--device cuda --nproc-per-node 1 --mixed-precision bf16 --quiet --json)
# an explicit schedule: the 20-step run must take the 40-step run's first 20 steps whatever the defaults
SMALL=(--model gpt-small --global-batch-size 8 --seq-len 256 --lr 6e-4 --warmup-steps 5)
LARGE=(--model gpt2-large --global-batch-size 8 --seq-len 1024)
XL=(--model gpt2-xl --mixed-precision bf16 --seq-len 1024)

part compat_straight 30 "$FSDPKIT" train "${ONE_GPU[@]}" "${SMALL[@]}" --steps 40
part compat_save 25 "$FSDPKIT" train "${ONE_GPU[@]}" "${SMALL[@]}" --steps 20 --save-dir "$RESULTS/compat-run"
part compat_resume 25 "$FSDPKIT" train "${ONE_GPU[@]}" "${SMALL[@]}" --steps 40 --resume "$RESULTS/compat-run"
part engine 140 "$PY" benchmarks/engine.py --backend nccl --nproc-per-node 1 "${XL[@]}" --batch 8 \
    --systems fsdpkit,fsdp2,ddp --trials 3 --steps 3 --warmup 2 --profile-steps 0 --json
part plan 15 "$FSDPKIT" plan --time --hardware "$PROFILE" "${XL[@]}" --global-batch-size 8 --world-size 1 --json
part plain 50 "$FSDPKIT" train "${ONE_GPU[@]}" "${LARGE[@]}" --steps 100
part snapshot 50 "$FSDPKIT" train "${ONE_GPU[@]}" "${LARGE[@]}" --steps 100 --max-restarts 1 --snapshot-every 10
part async_save 80 "$FSDPKIT" train "${ONE_GPU[@]}" "${LARGE[@]}" --steps 100 --async-save --save-every 10 --keep-last 1 \
    --save-dir "$RESULTS/async-run"
# tokens/s leaves the first step (the compilation) out: 30 steps measure the compiled step
part compile 60 "$FSDPKIT" train "${ONE_GPU[@]}" "${LARGE[@]}" --steps 30 --compile
part snapshot_check 30 "$PY" benchmarks/snapshot_check.py --device cuda --json

if [ "$DRY_RUN" = 1 ]; then
    printf 'report\t%s\n' "$PY benchmarks/plan_gpu_check.py $RESULTS"
    exit 0
fi
rm -rf "$RESULTS/compat-run" "$RESULTS/async-run"
"$PY" benchmarks/plan_gpu_check.py "$RESULTS"
