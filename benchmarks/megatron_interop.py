"""fsdpkit on Megatron-Core `torch_dist` checkpoints: time and peak memory of Megatron -> Hugging
Face and back, against `cp -r` of the checkpoint, side by side, alternating.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/megatron_interop.py --repeat 3
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/megatron_interop.py --layers 2 --repeat 1 --json

Set-up: a Llama-shaped transformers checkpoint of random bf16 weights (hidden 2048, 16 heads in
8 query groups, ffn 5632, vocab 32000, `--layers` 8: about 1.0 GB) is written with safetensors,
then converted by `fsdpkit convert --to megatron` into a `torch_dist` checkpoint (its time and
peak RSS are reported too). Each round runs, in an order that rotates from round to round, each
command as its own process, its input first dropped from the page cache (wall time with a final
`sync`, peak RSS from `wait4`): `fsdpkit convert MEGATRON OUT --to full` (unstacking the layers
and splitting QKV and fc1 as it copies), and `cp -r MEGATRON OUT`.

Reported: median and range over `--repeat` rounds, each command's peak RSS, the final `sync`'s
share of its time and its CPU seconds (user, system), and the ratio of convert to `cp -r` per
round; then the phases of convert (start: Python, the CLI's imports and parsing; open: the
checkpoint's metadata; copy; commit: the sync, rename and report) and the CPU seconds of copy
and commit, from one more run per round through the CLI in a process that times them; `--json`
prints them all. `--checkpoint DIR` times an existing `torch_dist` checkpoint instead (no set-up).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from dcp_interop import FSDPKIT, check_free, measure_rss, run, uncache

HIDDEN, HEADS, GROUPS, FFN, VOCAB = 2048, 16, 8, 5632, 32000
PHASES = ("start", "open", "copy", "commit")
CPU_PHASES = ("copy", "commit")  # their CPU seconds in user space and in the kernel are reported too


def write_llama(directory: Path, layers: int) -> int:
    """A Llama-shaped transformers checkpoint of random bf16 weights; its bytes."""
    import torch
    from safetensors.torch import save_file

    head = HIDDEN // HEADS
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * head, HIDDEN),
            p + "self_attn.k_proj.weight": (GROUPS * head, HIDDEN),
            p + "self_attn.v_proj.weight": (GROUPS * head, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * head),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "mlp.gate_proj.weight": (FFN, HIDDEN),
            p + "mlp.up_proj.weight": (FFN, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, FFN),
        }
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=generator, dtype=torch.bfloat16) * 0.02 for name, shape in shapes.items()}
    directory.mkdir(parents=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": GROUPS,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return sum(t.numel() * 2 for t in tensors.values())


def phase_child(megatron: Path, out: Path) -> None:
    """One `convert --to full` through the CLI in this process (spawned, input uncached), its
    phases timed: start (Python, the CLI's imports and parsing, from the parent's clock at
    spawn), open (reading the checkpoint's metadata into the Hugging Face view), copy (the data
    files), commit (their sync, the rename and the report); one JSON line on stdout."""
    spawned = float(os.environ["MEGATRON_INTEROP_SPAWNED"])
    import contextlib

    from fsdpkit_cli import app

    from fsdpkit.checkpoint.core import staging
    from fsdpkit.checkpoint.offline import formats

    marks: dict[str, float] = {}
    cpu: dict[str, resource.struct_rusage] = {}

    def marked(before: str, after: str, function):
        def run(*args, **kwargs):
            marks[before], cpu[before] = time.time(), resource.getrusage(resource.RUSAGE_SELF)
            try:
                return function(*args, **kwargs)
            finally:
                marks[after], cpu[after] = time.time(), resource.getrusage(resource.RUSAGE_SELF)

        return run

    formats.open_checkpoint = marked("open", "opened", formats.open_checkpoint)
    staging.sync_files = marked("commit", "synced", staging.sync_files)
    sys.argv = ["fsdpkit", "convert", str(megatron), str(out), "--to", "full"]
    with contextlib.redirect_stdout(sys.stderr), contextlib.suppress(SystemExit):
        app.main()
    ended, cpu["ended"] = time.time(), resource.getrusage(resource.RUSAGE_SELF)
    phases = {"start": marks["open"] - spawned, "open": marks["opened"] - marks["open"]}
    phases |= {"copy": marks["commit"] - marks["opened"], "commit": ended - marks["commit"]}
    for phase, (first, last) in zip(CPU_PHASES, [("opened", "commit"), ("commit", "ended")], strict=True):
        phases[f"{phase} user"] = cpu[last].ru_utime - cpu[first].ru_utime
        phases[f"{phase} system"] = cpu[last].ru_stime - cpu[first].ru_stime
    print(json.dumps(phases))


def phases_of_convert(megatron: Path, out: Path) -> dict[str, float]:
    uncache(megatron)
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRON_INTEROP_SPAWNED": repr(time.time())}
    found = subprocess.run(
        [sys.executable, __file__, "--phases-of", str(megatron), str(out)], env=environment, capture_output=True, text=True
    )
    shutil.rmtree(out, ignore_errors=True)
    if found.returncode or not found.stdout.strip():
        raise SystemExit(f"the phase run failed: {found.stderr[-400:]}")
    return json.loads(found.stdout.splitlines()[-1])


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


BASELINE = "baseline convert --to full"


def rounds(work: Path, megatron: Path, repeat: int, baseline: str | None) -> tuple[dict[str, list[dict]], list[dict[str, float]]]:
    convert = [FSDPKIT, "convert", str(megatron), str(work / "hf-out"), "--to", "full"]
    commands = {"fsdpkit convert --to full": convert, "cp -r": ["/bin/cp", "-r", str(megatron), str(work / "copy")]}
    if baseline is not None:
        commands[BASELINE] = convert
    results: dict[str, list[dict]] = {name: [] for name in commands}
    names = list(commands)
    phases: list[dict[str, float]] = []
    for round_ in range(repeat):
        turn = round_ % len(names)
        for name in names[turn:] + names[:turn]:
            uncache(megatron)
            with _pythonpath(baseline if name == BASELINE else None):
                results[name].append(measure_rss(commands[name]))
            for leftover in ("hf-out", "copy"):
                shutil.rmtree(work / leftover, ignore_errors=True)
        phases.append(phases_of_convert(megatron, work / "hf-out"))
    return results, phases


@contextlib.contextmanager
def _pythonpath(path: str | None) -> Iterator[None]:
    """PYTHONPATH set to `path` ('' : unset, the installed fsdpkit) while the block runs; nothing when None."""
    if path is None:
        yield
        return
    old = os.environ.pop("PYTHONPATH", None)
    if path:
        os.environ["PYTHONPATH"] = path
    try:
        yield
    finally:
        os.environ.pop("PYTHONPATH", None)
        if old is not None:
            os.environ["PYTHONPATH"] = old


def write_checkpoint(work: Path, layers: int) -> tuple[Path, int, dict]:
    """The Llama-shaped checkpoint converted to `torch_dist` under `work`; its safetensors
    bytes, and the time and peak RSS of `--to megatron`."""
    check_free(work, 4_500_000_000 * max(layers, 1) // 8, "the set-up and outputs")
    # written by a child: this process stays small, so its children's peak RSS is their own
    run([sys.executable, __file__, "--write-llama", str(work / "hf"), "--layers", str(layers)])
    size = sum(path.stat().st_size for path in (work / "hf").iterdir())
    uncache(work / "hf")
    setup = measure_rss([FSDPKIT, "convert", str(work / "hf"), str(work / "megatron"), "--to", "megatron"])
    shutil.rmtree(work / "hf")
    return work / "megatron", size, setup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--baseline", metavar="PYTHONPATH", help="also time convert with this PYTHONPATH (another checkout) in the same rounds"
    )
    parser.add_argument("--work", type=Path, default=None, help="Scratch directory (default: a temporary one, removed).")
    parser.add_argument("--checkpoint", type=Path, default=None, help="time this torch_dist checkpoint (kept) instead of writing one")
    parser.add_argument("--write-llama", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--phases-of", type=Path, nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phases_of is not None:
        phase_child(*args.phases_of)
        return 0
    if args.write_llama is not None:
        write_llama(args.write_llama, args.layers)
        return 0
    work = Path(tempfile.mkdtemp(prefix="megatron-interop-", dir=args.work))
    # fsdpkit's bytecode cached (the set-up's convert compiles it), as an installed package's is:
    # with PYTHONDONTWRITEBYTECODE set every timed run would compile fsdpkit's modules again
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(work / "bytecode")
    try:
        megatron, size, setup = args.checkpoint, 0, None
        if megatron is None:
            megatron, size, setup = write_checkpoint(work, args.layers)
        else:  # a convert untimed: the timed ones find fsdpkit's bytecode cached, as after the set-up
            run([FSDPKIT, "convert", str(megatron), str(work / "hf-out"), "--to", "full"])
            shutil.rmtree(work / "hf-out")
        results, phases = rounds(work, megatron, args.repeat, args.baseline)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = [c["seconds"] / p["seconds"] for c, p in zip(results["fsdpkit convert --to full"], results["cp -r"], strict=True)]
    before = [c["seconds"] / p["seconds"] for c, p in zip(results.get(BASELINE, []), results["cp -r"], strict=False)]
    document = {
        "checkpoint_bytes": size or sum(path.stat().st_size for path in megatron.rglob("*") if path.is_file()),
        "to_megatron": setup,
        "commands": {
            name: {
                "peak_rss": max(r["peak_rss"] for r in runs),
                **{key: summary([r[key] for r in runs]) for key in ("seconds", "sync_seconds", "user_seconds", "system_seconds")},
            }
            for name, runs in results.items()
        },
        "convert_over_cp": summary(ratios),
        **({"baseline_over_cp": summary(before)} if before else {}),
        "convert_phases": {phase: summary([found[phase] for found in phases]) for phase in phases[0]},
    }
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(f"checkpoint {document['checkpoint_bytes'] / 1e9:.2f} GB", end="")
        print(f"; --to megatron {setup['seconds']:.2f} s, peak RSS {setup['peak_rss'] / 1e6:.0f} MB" if setup else " (given)")
        for name, found in document["commands"].items():
            s = found["seconds"]
            print(
                f"{name:28} {s['median']:7.2f} s [{s['min']:.2f}, {s['max']:.2f}]  peak RSS {found['peak_rss'] / 1e6:5.0f} MB;"
                f" of it the final sync {_median_range(found['sync_seconds'])} s; CPU: user {_median_range(found['user_seconds'])} s,"
                f" system {_median_range(found['system_seconds'])} s"
            )
        r = document["convert_over_cp"]
        print(f"convert / cp -r per round: {r['median']:.2f}x [{r['min']:.2f}, {r['max']:.2f}]")
        if before:
            b = document["baseline_over_cp"]
            print(f"baseline convert / cp -r per round: {b['median']:.2f}x [{b['min']:.2f}, {b['max']:.2f}]")
        found = document["convert_phases"]
        print("phases of convert (one more run per round):", ", ".join(f"{p} {_median_range(found[p])} s" for p in PHASES))
        print(
            "their CPU:",
            ", ".join(
                f"{p}: user {_median_range(found[f'{p} user'])} s, system {_median_range(found[f'{p} system'])} s" for p in CPU_PHASES
            ),
        )
    return 0


def _median_range(found: dict) -> str:
    return f"{found['median']:.2f} [{found['min']:.2f}, {found['max']:.2f}]"


if __name__ == "__main__":
    sys.exit(main())
