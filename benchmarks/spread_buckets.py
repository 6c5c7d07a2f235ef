"""`convert s3:// s3://` spread over 2 processes against 1, side by side, on one S3 server:

    .venv/bin/python benchmarks/spread_buckets.py                      # 256 MB, moto's server, 3 rounds
    .venv/bin/python benchmarks/spread_buckets.py --size 1GB --rounds 5
    AWS_ENDPOINT_URL=... .venv/bin/python benchmarks/spread_buckets.py --bucket my-bench-bucket   # a real store

Makes an fsdpkit checkpoint of random fp32 tensors (16 MiB each) at 2 ranks and uploads it with
boto3, then, --rounds times after one uncounted round, converts it `--to full --dtype bf16
--max-shard-size 64MB` from the bucket into the bucket, each command in its own process: the
one-process command (staged in a local directory, then uploaded), and `--nproc-per-node 2`
(each rank reads its byte ranges and uploads its own files). Prints the wall time of each, the
median and range of the per-round ratio of 2 processes to 1, the peak RSS of the largest
process (wait4) and the load average at each round's start. Without AWS_ENDPOINT_URL it starts
moto's server in a process of its own; moto copies a whole object for each ranged GET and runs
on the same CPUs, so its figures show the server's costs as much as fsdpkit's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from object_storage import start_moto  # noqa: E402  (moto's server in a process of its own)

from fsdpkit.sizes import parse_size  # noqa: E402

FSDPKIT = [sys.executable, "-m", "fsdpkit_cli"]
SETUP = r"""
import subprocess, sys
from pathlib import Path
import boto3, torch
from safetensors.torch import save_file

size, bucket, work, create = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4] == "1"
client = boto3.client("s3")
if create:
    client.create_bucket(Bucket=bucket)
generator = torch.Generator().manual_seed(0)
tensors = {f"h.{i}.weight": torch.randn(2048, 2048, generator=generator) for i in range(max(1, size // (16 << 20)))}
save_file(tensors, str(work / "model.safetensors"), metadata={"format": "pt"})
del tensors
command = [sys.executable, "-m", "fsdpkit_cli", "convert", str(work / "model.safetensors"), str(work / "run"), "--to", "sharded"]
subprocess.run([*command, "--world-size", "2"], check=True, stdout=subprocess.DEVNULL)
for path in sorted((work / "run").iterdir()):
    client.upload_file(str(path), bucket, f"bench-spread/run/{path.name}")
"""


def _timed(command: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS bytes of the largest process) of one command and its children."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    if status != 0:
        raise SystemExit(f"{' '.join(command)} failed (status {status})")
    return time.perf_counter() - start, usage.ru_maxrss * 1024


def _run(args: argparse.Namespace, local_server: bool) -> None:
    url = f"s3://{args.bucket}/bench-spread"
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([sys.executable, "-c", SETUP, str(args.size), args.bucket, work, str(int(local_server))], check=True)
    flags = ["--to", "full", "--dtype", "bf16", "--max-shard-size", "64MB", "--overwrite"]
    commands = {
        n: [*FSDPKIT, "convert", f"{url}/run", f"{url}/out-{n}", *flags, *(["--nproc-per-node", "2"] if n == 2 else [])] for n in (1, 2)
    }
    for command in commands.values():  # compiles the bytecode, makes the outputs: not counted
        _timed(command)
    rounds = []
    for _ in range(args.rounds):
        load = os.getloadavg()[0]
        rounds.append((load, _timed(commands[1]), _timed(commands[2])))
    ratios = [two[0] / one[0] for _, one, two in rounds]
    where = "moto, this machine" if local_server else os.environ["AWS_ENDPOINT_URL"]
    print(f"{args.size / 1e6:.0f} MB of fp32 at 2 ranks -> full bf16, s3:// to s3://, {where}")
    for load, one, two in rounds:
        print(f"  load {load:5.1f}: 1 process {one[0]:6.2f} s ({one[1] >> 20} MiB), 2 processes {two[0]:6.2f} s ({two[1] >> 20} MiB)")
    print(
        f"2 processes / 1: median {statistics.median(ratios):.2f}x (range {min(ratios):.2f}x to {max(ratios):.2f}x), {os.cpu_count()} CPUs"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256MB", help="checkpoint bytes: 256MB, 1GB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket", default="fsdpkit-bench")
    args = parser.parse_args()
    args.size = parse_size(args.size)
    server = None
    if not os.environ.get("AWS_ENDPOINT_URL"):
        server, endpoint = start_moto()
        keys = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
        os.environ.update(AWS_ENDPOINT_URL=endpoint, **keys)
    try:
        _run(args, server is not None)
    finally:
        if server is not None:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
