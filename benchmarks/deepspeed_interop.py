"""fsdpkit on DeepSpeed ZeRO checkpoints against DeepSpeed's own tools, side by side, alternating.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/deepspeed_interop.py --model gpt2-medium --repeat 3
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/deepspeed_interop.py --model gpt-tiny --repeat 1 --json

Set-up: DeepSpeed (CPU, gloo, 2 ranks) trains the built-in `--model` one step with ZeRO-3 and
torch's AdamW, and saves it with `engine.save_checkpoint` (gpt2-medium: about 4.5 GB). Then each
round runs, in an order that rotates from round to round, each command as its own process, its
input first dropped from the page cache (wall time with a final `sync`, peak RSS from `wait4`):

- `fsdpkit convert DS OUT --to full` against DeepSpeed's `zero_to_fp32.py DS OUT` (the script
  DeepSpeed copies into the save directory; without `--safe_serialization`, which refuses the
  tied embeddings of GPT-2, so it writes torch's `pytorch_model.bin`);
- `fsdpkit reshard DS OUT --world-size N` (a DeepSpeed checkpoint for N ranks) against `cp -r`
  of the checkpoint, and DeepSpeed's `ds_to_universal` (what DeepSpeed needs to resume at
  another world size);
- `fsdpkit verify DS` against `cp -r`.

Reported: median and range over `--repeat` rounds, the peak RSS of each command, and the
ratios per round (median, range); `--json` prints them as one document.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from dcp_interop import FSDPKIT, check_free, measure_rss, run, torchrun, uncache

SAVE = """
import os, sys, torch
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed, deepspeed.comm.torch
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # gloo does without the JIT-built op
from fsdpkit.models.source import resolve
deepspeed.init_distributed(dist_backend="gloo")
source = resolve(sys.argv[1]); model = source.build(seed=0)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "steps_per_print": 10**9}
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
ids = torch.randint(0, 50, (1, 32))
engine.backward(source.logits(engine.module, ids).float().logsumexp(-1).mean())
engine.step()
engine.save_checkpoint(sys.argv[2])
"""

OUTPUTS = ("full", "ref", "re", "universal", "copy")


def clear(work: Path) -> None:
    for name in OUTPUTS:
        shutil.rmtree(work / name, ignore_errors=True)


def commands(work: Path, src: Path, reshard_to: int) -> dict[str, list[str]]:
    tag = src / (src / "latest").read_text().strip()
    python = sys.executable
    return {
        "fsdpkit convert --to full": [FSDPKIT, "convert", str(src), str(work / "full"), "--to", "full"],
        "zero_to_fp32.py": [python, str(src / "zero_to_fp32.py"), str(src), str(work / "ref")],
        f"fsdpkit reshard -> {reshard_to}": [FSDPKIT, "reshard", str(src), str(work / "re"), "--world-size", str(reshard_to)],
        "ds_to_universal": [
            python,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(tag),
            "--output_folder",
            str(work / "universal"),
            "--inject_missing_state",
        ],
        "fsdpkit verify": [FSDPKIT, "verify", str(src)],
        "cp -r": ["/bin/cp", "-r", str(src), str(work / "copy")],
    }


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def results_document(results: dict[str, list[dict]], reshard_to: int) -> dict:
    """Each command's seconds and peak RSS, and the ratios per round."""
    ratios = {
        "convert --to full / zero_to_fp32": ("fsdpkit convert --to full", "zero_to_fp32.py"),
        f"reshard -> {reshard_to} / cp -r": (f"fsdpkit reshard -> {reshard_to}", "cp -r"),
        f"reshard -> {reshard_to} / ds_to_universal": (f"fsdpkit reshard -> {reshard_to}", "ds_to_universal"),
        "verify / cp -r": ("fsdpkit verify", "cp -r"),
    }
    return {
        "commands": {
            name: {"seconds": summary([r["seconds"] for r in runs]), "peak_rss_mb": max(r["peak_rss"] for r in runs) / 1e6}
            for name, runs in results.items()
        },
        "ratios": {
            label: summary([x["seconds"] / y["seconds"] for x, y in zip(results[a], results[b], strict=True)])
            for label, (a, b) in ratios.items()
        },
    }


def print_table(document: dict) -> None:
    def line(values: dict[str, float]) -> str:
        return f"{values['median']:8.2f} [{values['min']:.2f}, {values['max']:.2f}]"

    print(f"{'':42} {'seconds: median [range]':>26} {'peak RSS MB':>12}")
    for name, values in document["commands"].items():
        print(f"{name:42} {line(values['seconds']):>26} {values['peak_rss_mb']:12.0f}")
    print("\nratios per round: median [range]")
    for label, values in document["ratios"].items():
        print(f"{label:42} {line(values):>26}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-medium", help="A built-in model (gpt-tiny for a quick check).")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--reshard-to", type=int, default=64)
    parser.add_argument("--expect-gb", type=float, default=5.0, help="Free disk needed for the set-up's checkpoint (gpt2-medium: 4.5).")
    parser.add_argument("--work", type=Path, default=None, help="Scratch directory (default: a temporary one, removed).")
    parser.add_argument("--json", action="store_true", help="Print one JSON document instead of the table.")
    args = parser.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="deepspeed-interop-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        (work / "save.py").write_text(SAVE)
        src = work / "ds"
        check_free(work, args.expect_gb * 1e9, "the DeepSpeed checkpoint")
        run(torchrun(2, work / "save.py", args.model, str(src)))
        size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        check_free(work, int(2.2 * size), "the largest output")
        print(f"{args.model}: DeepSpeed ZeRO-3 at 2 ranks, {size / 1e9:.2f} GB, {args.repeat} rounds", file=sys.stderr)
        measured = commands(work, src, args.reshard_to)
        load_at_start = os.getloadavg()
        results: dict[str, list[dict]] = {name: [] for name in measured}
        names = list(measured)
        for round_ in range(args.repeat):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                uncache(src)
                results[name].append(measure_rss(measured[name]))
                clear(work)
        document = {
            "model": args.model,
            "checkpoint_bytes": size,
            "rounds": args.repeat,
            **results_document(results, args.reshard_to),
            "load_average": {"start": load_at_start, "end": os.getloadavg()},
        }
        if args.json:
            print(json.dumps(document, indent=2))
        else:
            print_table(document)
            print(f"load average (1, 5, 15 min) at the start {load_at_start}, at the end {document['load_average']['end']}")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
