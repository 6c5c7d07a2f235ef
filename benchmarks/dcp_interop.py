"""fsdpkit on torch DCP checkpoints against torch's own tools, side by side, alternating.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dcp_interop.py --model gpt2-medium --repeat 3

Set-up: FSDP2 (`fully_shard` per block) at 2 ranks builds the built-in `--model` with AdamW state
(`get_state_dict` initialises it) and saves it with `dcp.save` in torch's `{"model",
"optimizer"}` layout (gpt2-medium: about 4 GB). Then each round runs, in an order that rotates
from round to round, each command as its own process, its input first dropped from the page
cache (wall time with a final `sync`, peak RSS from `wait4`):

- `fsdpkit convert DCP OUT --to full` against torch's `dcp_to_torch_save` followed by writing
  the model's tensors as safetensors (what a user does without fsdpkit); torch's
  `_consolidate_hf_safetensors` does not apply (it reads only DCP's Hugging Face storage layout);
- `fsdpkit reshard DCP OUT --world-size 64` and `fsdpkit convert DCP OUT --to sharded
  --world-size 64 --model M` against `cp -r` of the checkpoint;
- FSDP2 at 4 ranks loading (`dcp.load` + `set_state_dict`, model and optimizer) fsdpkit's
  reshard to 4 against the original (DCP reshards as it loads): the load time of rank 0.

Reported: median and range over `--repeat` rounds, and the ratios per round (median, range).
Disk: the source, its reshard to 4 and one output at a time (torch's `.pt` and safetensors the
largest, about 1.4x the source): free space is checked before and after the set-up, and each
output is deleted once measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FSDPKIT = str(Path(sys.executable).with_name("fsdpkit"))

SAVE = """
import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import get_state_dict
from fsdpkit.models.source import resolve
dist.init_process_group("gloo")
source = resolve(sys.argv[1]); model = source.build(seed=0); units = source.unit_classes(model)
for module in model.modules():
    if units and isinstance(module, units): fully_shard(module)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
model_sd, optim_sd = get_state_dict(model, optimizer)
dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=sys.argv[2])
dist.destroy_process_group()
"""

LOAD = """
import sys, time, json, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from fsdpkit.models.source import resolve
dist.init_process_group("gloo")
source = resolve(sys.argv[1]); model = source.build(seed=1); units = source.unit_classes(model)
for module in model.modules():
    if units and isinstance(module, units): fully_shard(module)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
model_sd, optim_sd = get_state_dict(model, optimizer)
state = {"model": model_sd, "optimizer": optim_sd}
dist.barrier(); start = time.perf_counter()
dcp.load(state, checkpoint_id=sys.argv[2])
set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
dist.barrier()
if dist.get_rank() == 0: print(json.dumps({"load_seconds": time.perf_counter() - start}))
dist.destroy_process_group()
"""

TORCH_TO_FULL = """
import sys, torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2] + ".pt")
state = torch.load(sys.argv[2] + ".pt", weights_only=False)
save_file({k: v.contiguous() for k, v in state["model"].items()}, sys.argv[2] + ".safetensors")
"""


def run(command: list[str]) -> str:
    """Run a set-up or load command; its stdout."""
    proc = subprocess.run(command, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(command[:4])}... failed: {proc.stderr[-400:]}")
    return proc.stdout


def uncache(directory: Path) -> None:
    """Drop the (clean, synced) pages of every file under `directory` from the page cache, so
    that each command reads its input from disk whatever ran before it."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def measure_rss(command: list[str]) -> dict:
    """Wall time including a final `sync` (`sync_seconds` of it), the peak RSS of the command
    (wait4: the largest of the process and the children it waited for) and its CPU seconds in
    user space and in the kernel."""
    start = time.perf_counter()
    pid = os.posix_spawn(
        command[0],
        command,
        {**os.environ, "OMP_NUM_THREADS": "1"},
        file_actions=[(os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0), (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)],
    )
    _, status, usage = os.wait4(pid, 0)
    ended = time.perf_counter()
    subprocess.run(["sync"], check=True)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(command[:4])}... failed")
    synced = time.perf_counter()
    return {
        "seconds": synced - start,
        "sync_seconds": synced - ended,
        "peak_rss": usage.ru_maxrss * 1024,
        "user_seconds": usage.ru_utime,
        "system_seconds": usage.ru_stime,
    }


def check_free(work: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(work).free
    print(f"free disk at {work}: {free / 1e9:.1f} GB ({what} needs about {needed / 1e9:.1f} GB)", file=sys.stderr)
    if free < needed:
        raise SystemExit(f"not enough free disk at {work}: {free / 1e9:.1f} GB, {what} needs about {needed / 1e9:.1f} GB (use --work)")


def clear(work: Path) -> None:
    for leftover in ("full", "torch.pt", "torch.safetensors", "re", "sh", "copy"):
        path = work / leftover
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def torchrun(nproc: int, script: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script), *args]


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):8.2f} [{min(values):.2f}, {max(values):.2f}]"


def report(results: dict[str, list[dict]], reshard_to: int) -> None:
    """Each command's times and peak RSS, then the ratios per round."""
    print(f"{'':46} {'seconds: median [range]':>26} {'peak RSS MB':>12}")
    for name, runs in results.items():
        rss = max(r["peak_rss"] for r in runs) / 1e6
        print(f"{name:46} {summary([r['seconds'] for r in runs]):>26} {rss:12.0f}")
    ratios = {
        "convert --to full / torch": ("fsdpkit convert --to full", "torch dcp_to_torch_save + safetensors"),
        f"reshard -> {reshard_to} / cp -r": (f"fsdpkit reshard -> {reshard_to}", "cp -r"),
        f"convert --to sharded {reshard_to} / cp -r": (f"fsdpkit convert --to sharded {reshard_to}", "cp -r"),
        "FSDP2 load from fsdpkit reshard / from original": ("FSDP2 load at 4 from fsdpkit reshard", "FSDP2 load at 4 from original"),
    }
    print("\nratios per round: median [range]")
    for label, (a, b) in ratios.items():
        values = [x["seconds"] / y["seconds"] for x, y in zip(results[a], results[b], strict=True)]
        print(f"{label:46} {summary(values):>26}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-medium")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--reshard-to", type=int, default=64)
    parser.add_argument("--expect-gb", type=float, default=5.0, help="Free disk needed for the set-up's checkpoint (gpt2-medium: 4.5).")
    parser.add_argument("--work", type=Path, default=None, help="Scratch directory (default: a temporary one, removed).")
    args = parser.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="dcp-interop-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        for name, text in (("save.py", SAVE), ("load.py", LOAD), ("torch_full.py", TORCH_TO_FULL)):
            (work / name).write_text(text)
        src = work / "dcp"
        check_free(work, args.expect_gb * 1e9, "the DCP checkpoint")
        run(torchrun(2, work / "save.py", args.model, str(src)))
        size = sum(f.stat().st_size for f in src.iterdir())
        check_free(work, int(2.6 * size), "a reshard and the largest output")
        print(
            f"{args.model}: DCP from FSDP2 at 2 ranks, {size / 1e9:.2f} GB, {args.repeat} rounds",
            file=sys.stderr,
        )
        r4 = work / "r4"
        run([FSDPKIT, "reshard", str(src), str(r4), "--world-size", "4"])
        commands = {
            "fsdpkit convert --to full": [FSDPKIT, "convert", str(src), str(work / "full"), "--to", "full"],
            "torch dcp_to_torch_save + safetensors": [sys.executable, str(work / "torch_full.py"), str(src), str(work / "torch")],
            f"fsdpkit reshard -> {args.reshard_to}": [FSDPKIT, "reshard", str(src), str(work / "re"), "--world-size", str(args.reshard_to)],
            f"fsdpkit convert --to sharded {args.reshard_to}": [
                FSDPKIT,
                "convert",
                str(src),
                str(work / "sh"),
                "--to",
                "sharded",
                "--world-size",
                str(args.reshard_to),
                "--model",
                args.model,
            ],
            "cp -r": ["/bin/cp", "-r", str(src), str(work / "copy")],
        }
        load_at_start = os.getloadavg()
        loads = {"FSDP2 load at 4 from fsdpkit reshard": r4, "FSDP2 load at 4 from original": src}
        results: dict[str, list[dict]] = {name: [] for name in [*commands, *loads]}
        names = list(results)
        for round_ in range(args.repeat):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                uncache(src)
                uncache(r4)
                if name in commands:
                    results[name].append(measure_rss(commands[name]))
                else:
                    out = run(torchrun(4, work / "load.py", args.model, str(loads[name])))
                    results[name].append({"seconds": json.loads(out.strip().splitlines()[-1])["load_seconds"], "peak_rss": 0})
                clear(work)
        report(results, args.reshard_to)
        print(f"load average (1, 5, 15 min) at the start {load_at_start}, at the end {os.getloadavg()}")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
