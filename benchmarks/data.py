"""What reading documents costs training: `fsdpkit train` on one corpus as a prepared `.bin`
token file, as jsonl (packed and tokenised by the loader), and as parquet shards streamed with
--data-streaming, side by side, alternating; step time as ratios to the `.bin` run, and the
data-loading time per step (the wait for the batch, which should be hidden behind compute).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/data.py --repeat 3
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/data.py --megabytes 1 --steps 6 --model gpt-tiny --seq-len 64 --repeat 1 --json

The corpus is generated (words drawn with a fixed seed, documents of varied length), written
once as jsonl, as parquet shards (one per rank at least) and, with `fsdpkit prepare-data`, as
`.bin`, in a temporary directory removed afterwards. Each run is its own process tree
(`fsdpkit train --json --metrics`); its step time is the median over the steps after the first
of `step_time_s`, and its data time the median of `data_time_s`, from its --metrics file.
--rss also reports the streamed run's peak RSS (a worker's own, the largest of the ranks) at two
corpus sizes, --megabytes and 100x it (hard links to its shards), which must not grow with the
dataset.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

FSDPKIT = str(Path(sys.executable).with_name("fsdpkit"))
WORDS = "the of and to in is was for on that with as by at from his her an which were are this be had it not".split()


def write_corpus(directory: Path, megabytes: float, shards: int) -> dict[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    texts, size = [], 0
    while size < megabytes * 1e6:
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(20, 400))))
        texts.append(text)
        size += len(text) + 1
    jsonl = directory / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (directory / "shards").mkdir()
    per = -(-len(texts) // shards)
    for index in range(shards):
        pq.write_table(pa.table({"text": texts[index * per : (index + 1) * per]}), directory / "shards" / f"{index:04d}.parquet")
    tokens = directory / "corpus.bin"
    subprocess.run([FSDPKIT, "prepare-data", str(jsonl), str(tokens)], check=True, stdout=subprocess.DEVNULL)
    return {"bin": str(tokens), "jsonl": str(jsonl), "streamed parquet": str(directory / "shards")}


def hundredfold(shards: Path, directory: Path) -> str:
    """A corpus 100 times larger: 100 hard links to each parquet shard (no copy, no writing)."""
    (directory / "shards").mkdir(parents=True)
    for shard in sorted(shards.glob("*.parquet")):
        for copy in range(100):
            (directory / "shards" / f"{copy:03d}-{shard.name}").hardlink_to(shard)
    return str(directory / "shards")


def train(data: str, streaming: bool, args: argparse.Namespace, directory: Path) -> dict:
    metrics = directory / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    command = [FSDPKIT, "train", "--data", data, "--model", args.model, "--nproc-per-node", str(args.ranks)]
    command += ["--steps", str(args.steps), "--seq-len", str(args.seq_len), "--global-batch-size", str(args.batch)]
    command += ["--metrics", str(metrics), "--quiet", "--json"] + (["--data-streaming"] if streaming else [])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)}\n{done.stderr.strip()}")
    summary = json.loads(done.stdout)
    records = [json.loads(line) for line in metrics.read_text().splitlines()][1:]
    return {
        "step_s": statistics.median(r["step_time_s"] for r in records),
        "data_s": statistics.median(r["data_time_s"] for r in records),
        "peak_rss": summary["peak_memory_bytes"],
    }


def measure(args: argparse.Namespace, root: Path) -> dict:
    """Every source --repeat times, alternating; step and data times as medians, ratios to .bin."""
    sources = write_corpus(root, args.megabytes, max(args.ranks, 4))
    runs: dict[str, list[dict]] = {name: [] for name in sources}
    for round_index in range(args.repeat):
        names = list(sources)
        names = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in names:
            runs[name].append(train(sources[name], name.startswith("streamed"), args, root))
    base = statistics.median(r["step_s"] for r in runs["bin"])
    results: dict = {"settings": vars(args), "sources": {}}
    for name, measured in runs.items():
        step = statistics.median(r["step_s"] for r in measured)
        results["sources"][name] = {
            "step_s": step,
            "ratio_to_bin": step / base,
            "data_s_per_step": statistics.median(r["data_s"] for r in measured),
        }
    if args.rss:
        large = root / "large"
        big = hundredfold(Path(sources["streamed parquet"]), large)
        results["streamed_peak_rss"] = {
            f"{args.megabytes:g} MB": runs["streamed parquet"][-1]["peak_rss"],
            f"{args.megabytes * 100:g} MB": train(big, True, args, large)["peak_rss"],
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--megabytes", type=float, default=10.0, help="Corpus size in MB of text.")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rss", action="store_true", help="Also stream a corpus 100x larger and compare peak RSS.")
    parser.add_argument("--json", action="store_true", help="Print one JSON document instead of the table.")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fsdpkit-data-bench-"))
    try:
        results = measure(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{args.model}, {args.ranks} ranks, {args.batch} x {args.seq_len} tokens, {args.megabytes:g} MB corpus, {args.repeat} rounds")
    for name, result in results["sources"].items():
        step, ratio, data = result["step_s"], result["ratio_to_bin"], result["data_s_per_step"]
        print(f"{name:18s} step {step * 1e3:8.1f} ms  ({ratio:.3f}x .bin)  data wait {data * 1e3:7.2f} ms/step")
    for size, peak in results.get("streamed_peak_rss", {}).items():
        print(f"streamed peak RSS at {size}: {peak / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
