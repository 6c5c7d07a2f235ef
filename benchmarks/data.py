"""What reading documents costs training: `fsdpkit train` on one corpus as a prepared `.bin`
token file, as jsonl (packed and tokenised by the loader), and as parquet shards streamed with
--data-streaming, side by side, alternating; step time as ratios to the `.bin` run, and the
data-loading time per step (the wait for the batch, which should be hidden behind compute).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/data.py --repeat 3
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/data.py --megabytes 1 --steps 6 --model gpt-tiny --repeat 1

The corpus is generated (words drawn with a fixed seed, documents of varied length), written
once as jsonl, as parquet shards (one per rank at least) and, with `fsdpkit prepare-data`, as
`.bin`, in a temporary directory removed afterwards. Each run is its own process tree
(`fsdpkit train --json --metrics`); its step time is the median over the steps after the first
of `step_time_s`, and its data time the median of `data_time_s`, from its --metrics file.
--rss also reports each streamed run's peak RSS at two corpus sizes (--megabytes and 100x it),
which must not grow with the dataset.
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


def train(data: str, streaming: bool, args: argparse.Namespace, directory: Path) -> dict:
    metrics = directory / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    command = [FSDPKIT, "train", "--data", data, "--model", args.model, "--nproc-per-node", str(args.ranks)]
    command += ["--steps", str(args.steps), "--seq-len", str(args.seq_len), "--global-batch-size", str(args.batch)]
    command += ["--metrics", str(metrics), "--quiet", "--json"] + (["--data-streaming"] if streaming else [])
    summary = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    records = [json.loads(line) for line in metrics.read_text().splitlines()][1:]
    return {
        "step_s": statistics.median(r["step_time_s"] for r in records),
        "data_s": statistics.median(r["data_time_s"] for r in records),
        "peak_rss": summary["peak_memory_bytes"],
    }


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
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fsdpkit-data-bench-"))
    try:
        sources = write_corpus(root, args.megabytes, max(args.ranks, 4))
        runs: dict[str, list[dict]] = {name: [] for name in sources}
        for round_index in range(args.repeat):
            names = list(sources)
            names = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in names:
                runs[name].append(train(sources[name], name.startswith("streamed"), args, root))
        base = statistics.median(r["step_s"] for r in runs["bin"])
        print(f"{args.model}, {args.ranks} ranks, {args.batch} x {args.seq_len} tokens, {args.megabytes:g} MB corpus, {args.repeat} rounds")
        for name, results in runs.items():
            step = statistics.median(r["step_s"] for r in results)
            data = statistics.median(r["data_s"] for r in results)
            print(f"{name:18s} step {step * 1e3:8.1f} ms  ({step / base:.3f}x .bin)  data wait {data * 1e3:7.2f} ms/step")
        if args.rss:
            large = root / "large"
            large.mkdir()
            big = write_corpus(large, args.megabytes * 100, max(args.ranks, 4))["streamed parquet"]
            small_rss = runs["streamed parquet"][-1]["peak_rss"]
            large_rss = train(big, True, args, large)["peak_rss"]
            sizes = f"{small_rss / 2**20:.0f} MiB at {args.megabytes:g} MB, {large_rss / 2**20:.0f} MiB at {args.megabytes * 100:g} MB"
            print(f"streamed peak RSS: {sizes}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
