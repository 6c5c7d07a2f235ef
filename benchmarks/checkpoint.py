"""Checkpoint conversion benchmark: fsdpkit convert/reshard vs torch DCP vs `cp -r` + `sync`.

    .venv/bin/python benchmarks/checkpoint.py                        # gpt2-large weights (~3.1 GB)
    .venv/bin/python benchmarks/checkpoint.py --model gpt2-xl        # ~6.2 GB
    .venv/bin/python benchmarks/checkpoint.py --model gpt2 --with-optimizer --json

Makes one set of random weights with the model's real shapes (and Adam moments with
--with-optimizer), saved three ways: an fsdpkit sharded checkpoint (W ranks, the model's
flat-parameter plan), a torch DCP checkpoint (FileSystemWriter) and a DCP Hugging Face
sharded safetensors checkpoint (HuggingFaceStorageWriter). Then runs, each in its own
process, timed with a final `sync` included, peak RSS from wait4:

- fsdpkit convert --to full       (sharded W -> model.safetensors)
- fsdpkit reshard --world-size M  (W -> M)
- torch dcp_to_torch_save         (DCP -> one torch.save file)
- torch consolidate_safetensors_files (DCP HF shards -> consolidated safetensors)
- cp -r + sync of the fsdpkit checkpoint (the disk's limit)

and prints them side by side (median of --repeat interleaved runs) with ratios to `cp -r` + `sync`. Free disk is checked first;
outputs are deleted as soon as measured. Peak RSS is GNU time's %M (needs /usr/bin/time).
The DCP sources are single-process saves (no process group needed); fsdpkit's has W ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fsdpkit.checkpoint.core.bytecopy import DEFAULT_CHUNK_SIZE  # noqa: E402  (torch-free imports only here)
from fsdpkit.sizes import format_size, parse_size  # noqa: E402

SETUP = r"""
import json, sys, torch
from pathlib import Path
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter
from fsdpkit.models.units import unit_specs_for_model
from fsdpkit.checkpoint.format import storage
from fsdpkit.checkpoint.format.manifest import Manifest
from fsdpkit.checkpoint.format.placement import Placement, TensorSpec
from fsdpkit.checkpoint.live.save_protocol import write_rank
from fsdpkit.flat_layout import ElementRange

work, model, world, with_optim = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
units = unit_specs_for_model(model)
g = torch.Generator().manual_seed(0)
state = {name: torch.randn(shape, generator=g) for unit in units for name, shape in unit}
if with_optim:
    for name, shape in [(n, s) for u in units for n, s in u]:
        state[f"optim.exp_avg.{name}"] = torch.randn(shape, generator=g) * 1e-3
        state[f"optim.exp_avg_sq.{name}"] = torch.rand(shape, generator=g) * 1e-6
    state["optim.step"] = torch.tensor(1000.0)
manifest = Manifest(world, "full", Placement.flat(units), tuple(TensorSpec(n, "F32", tuple(t.shape)) for n, t in state.items()),
                    {}, {"step": 1})
tmp = storage.begin(work / "fsdpkit", 1)
whole = {n: (ElementRange(0, t.numel()), t.reshape(-1)) for n, t in state.items()}
for rank in range(world):
    write_rank(tmp, manifest, rank, whole)
storage.commit(tmp, work / "fsdpkit", 1, manifest)
dcp.save(state, storage_writer=FileSystemWriter(str(work / "dcp")), no_dist=True)
dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(work / "dcp_hf"), save_distributed=True,
         fqn_to_index_mapping={n: 1 for n in state}), no_dist=True)
json.dump({"bytes": sum(t.numel() * t.element_size() for t in state.values()), "tensors": len(state)},
          open(work / "setup.json", "w"))
"""

DCP_TO_TORCH = (
    "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; dcp_to_torch_save(sys.argv[1], sys.argv[2])"
)
CONSOLIDATE = (
    "import sys, json, os; os.makedirs(sys.argv[2]); "
    "from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files; "
    "consolidate_safetensors_files(sys.argv[1], sys.argv[2], json.load(open(sys.argv[3])))"
)


def measure(command: list[str], env: dict | None = None) -> dict:
    """Wall time including a final `sync`, and the command's peak RSS (GNU time's %M: the
    child of a tiny process, so nothing of this one is counted)."""
    start = time.perf_counter()
    proc = subprocess.run(
        ["/usr/bin/time", "-f", "PEAKRSS %M", *command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True
    )
    subprocess.run(["sync"], check=True)
    seconds = time.perf_counter() - start
    lines = proc.stderr.strip().splitlines()
    peak = next((int(line.split()[1]) for line in reversed(lines) if line.startswith("PEAKRSS")), 0)
    errors = [line for line in lines if not line.startswith(("PEAKRSS", "Command exited"))]
    return {
        "seconds": seconds,
        "peak_rss": peak * 1024,
        "ok": proc.returncode == 0,
        "error": errors[-1] if proc.returncode and errors else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-large", help="model whose parameter shapes are used (fsdpkit registry)")
    parser.add_argument("--with-optimizer", action="store_true", help="add Adam moments (3x the bytes)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks of the source checkpoint")
    parser.add_argument("--reshard-to", type=int, default=4, help="ranks of the reshard output")
    parser.add_argument("--chunk-size", default=None, help="fsdpkit --chunk-size (default: fsdpkit's own default)")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each tool, interleaved; the median time is reported")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)

    python = sys.executable
    fsdpkit_cli = [python, "-c", "from fsdpkit_cli.app import main; main()"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    work = Path(tempfile.mkdtemp(prefix="fsdpkit-ckpt-bench-", dir=args.workdir))
    try:
        if not Path("/usr/bin/time").exists():
            print("error: this benchmark measures peak RSS with /usr/bin/time (GNU time); install it", file=sys.stderr)
            return 1
        params = _estimate_bytes(python, args.model) * (3 if args.with_optimizer else 1)
        free = shutil.disk_usage(work).free
        needed = params * 5 + (1 << 30)  # three source copies + one output at a time + slack
        if free < needed:
            print(f"error: benchmark needs about {format_size(needed)} free in {work}, {format_size(free)} free", file=sys.stderr)
            return 1
        print(f"setting up {args.model} ({format_size(params)}) in {work} ...", file=sys.stderr)
        setup = subprocess.run(
            [python, "-c", SETUP, str(work), args.model, str(args.world_size), "1" if args.with_optimizer else "0"], env=env
        )
        if setup.returncode:
            return 1
        subprocess.run(["sync"], check=True)  # the setup's dirty pages must not slow the first tool down
        info = json.loads((work / "setup.json").read_text())
        src = work / "fsdpkit"
        mapping = work / "mapping.json"
        hf_src = work / "dcp_hf" / "sharded" if (work / "dcp_hf" / "sharded").is_dir() else work / "dcp_hf"
        header_names = _hf_tensor_names(hf_src)
        mapping.write_text(json.dumps({n: 1 for n in header_names}))
        chunk = ["--chunk-size", args.chunk_size] if args.chunk_size else []
        runs = [
            ("fsdpkit convert --to full", fsdpkit_cli + ["convert", str(src), str(work / "out"), "--to", "full", *chunk]),
            (
                f"fsdpkit reshard {args.world_size}->{args.reshard_to}",
                fsdpkit_cli + ["reshard", str(src), str(work / "out"), "--world-size", str(args.reshard_to), *chunk],
            ),
            ("torch dcp_to_torch_save", [python, "-c", DCP_TO_TORCH, str(work / "dcp"), str(work / "out.pt")]),
            ("torch consolidate_safetensors_files", [python, "-c", CONSOLIDATE, str(hf_src), str(work / "out"), str(mapping)]),
            ("cp -r + sync", ["cp", "-r", str(src), str(work / "out")]),
        ]
        trials: dict[str, list[dict]] = {name: [] for name, _ in runs}
        for repeat in range(args.repeat):
            for name, command in runs:
                print(f"running {name} ({repeat + 1}/{args.repeat}) ...", file=sys.stderr)
                trials[name].append(measure(command, env))
                shutil.rmtree(work / "out", ignore_errors=True)
                (work / "out.pt").unlink(missing_ok=True)
                subprocess.run(["sync"], check=True)
                time.sleep(1.0)  # let the freed blocks' discards settle before the next tool
        results = []
        for name, _ in runs:
            runs_of = trials[name]
            ordered = sorted(r["seconds"] for r in runs_of)
            results.append(
                {
                    "name": name,
                    "seconds": ordered[len(ordered) // 2],
                    "all_seconds": [r["seconds"] for r in runs_of],
                    "peak_rss": max(r["peak_rss"] for r in runs_of),
                    "ok": all(r["ok"] for r in runs_of),
                    "error": next((r["error"] for r in runs_of if r["error"]), None),
                }
            )
        baseline = next(r["seconds"] for r in results if r["name"] == "cp -r + sync")
        for r in results:
            r["vs_cp"] = r["seconds"] / baseline
            r["gb_per_s"] = info["bytes"] / r["seconds"] / 1e9
        document = {
            "model": args.model,
            "with_optimizer": args.with_optimizer,
            "bytes": info["bytes"],
            "tensors": info["tensors"],
            "world_size": args.world_size,
            "reshard_to": args.reshard_to,
            "chunk_size": parse_size(args.chunk_size or str(DEFAULT_CHUNK_SIZE)),
            "results": results,
        }
        if args.json:
            print(json.dumps(document))
        else:
            print(
                f"# {args.model}{' + Adam state' if args.with_optimizer else ''}: {info['tensors']} tensors, "
                f"{format_size(info['bytes'])}; source W={args.world_size}; chunk {args.chunk_size or format_size(DEFAULT_CHUNK_SIZE)}"
            )
            print(f"{'tool':<40}{'time s':>9}{'GB/s':>8}{'peak RSS':>12}{'x cp+sync':>11}  all runs (s)")
            for r in results:
                status = "" if r["ok"] else f"  FAILED: {r['error']}"
                all_runs = " ".join(f"{x:.1f}" for x in r["all_seconds"])
                print(
                    f"{r['name']:<40}{r['seconds']:>9.2f}{r['gb_per_s']:>8.2f}{format_size(r['peak_rss']):>12}{r['vs_cp']:>11.2f}"
                    f"  {all_runs}{status}"
                )
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _estimate_bytes(python: str, model: str) -> int:
    code = (
        "import sys; from fsdpkit.models.units import unit_specs_for_model; import math; "
        "print(sum(math.prod(s) * 4 for u in unit_specs_for_model(sys.argv[1]) for _, s in u))"
    )
    return int(subprocess.run([python, "-c", code, model], capture_output=True, text=True, check=True).stdout)


def _hf_tensor_names(directory: Path) -> list[str]:
    from fsdpkit.checkpoint.format.reader import read_header

    names = []
    for path in sorted(directory.glob("*.safetensors")):
        names += list(read_header(path).tensors)
    return names


if __name__ == "__main__":
    sys.exit(main())
