"""Object-storage benchmark: `fsdpkit verify s3://` and `fsdpkit convert s3:// s3://` against
boto3 moving the same objects on the same server, side by side in one run.

    .venv/bin/python benchmarks/object_storage.py                 # 256 MB checkpoint, 4 ranks, moto's server
    .venv/bin/python benchmarks/object_storage.py --size 1GB --world-size 8
    AWS_ENDPOINT_URL=... .venv/bin/python benchmarks/object_storage.py --bucket my-bench-bucket   # a real store

Makes a full safetensors checkpoint of random fp32 tensors (4 M elements each, gpt2-sized
layers), converts it locally to fsdpkit's sharded format at --world-size ranks, uploads it with
boto3, then times, each in its own process (peak RSS and CPU time from wait4), median of
--repeat interleaved rounds after one that compiles the bytecode:

- fsdpkit verify s3://...     (every fragment's crc32 as the bytes stream in)
- boto3 download_fileobj      (max_concurrency=10, into a sink that keeps nothing)
- boto3 get_object            (one streamed GET per object, read in 8 MB pieces)
- fsdpkit convert s3://run s3://out --to full
- boto3 download + upload     (download_file of the source's objects, max_concurrency=10, then
                               upload_file of the full output, made locally beforehand)

and prints the ratio of verify to the faster boto3 reader and of convert to boto3's transfers.
`--only convert` times the convert rows alone; `--baseline DIR` (a checkout of another fsdpkit
commit, e.g. `git worktree add --detach /tmp/base main`) times that checkout's convert in the
same rounds, as a before/after under the same load:

    .venv/bin/python benchmarks/object_storage.py --only convert --baseline /tmp/base

Without AWS_ENDPOINT_URL it starts
moto's server (`moto[server]`) in a process of its own on 127.0.0.1; moto copies a whole object
for each ranged GET, so its figures show the server's costs as much as the clients'.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fsdpkit.sizes import format_size, parse_size  # noqa: E402

CONVERT = "fsdpkit convert s3:// s3://"
BASELINE = "fsdpkit convert (--baseline)"
READERS = {
    "boto3 download_fileobj": r"""
import sys, boto3
from boto3.s3.transfer import TransferConfig
class Sink:
    def write(self, data): return len(data)
client, bucket, prefix = boto3.client("s3"), sys.argv[1], sys.argv[2]
config = TransferConfig(max_concurrency=10)
for item in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]:
    client.download_fileobj(bucket, item["Key"], Sink(), Config=config)
""",
    "boto3 get_object": r"""
import sys, boto3
client, bucket, prefix = boto3.client("s3"), sys.argv[1], sys.argv[2]
for item in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]:
    body = client.get_object(Bucket=bucket, Key=item["Key"])["Body"]
    while body.read(8 << 20):
        pass
""",
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start_moto() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    for _ in range(100):
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return server, f"http://127.0.0.1:{port}"
        time.sleep(0.1)
    server.kill()
    raise SystemExit("moto's server did not start")


SETUP = r"""
import subprocess, sys, tempfile
from pathlib import Path
import boto3, torch
from safetensors.torch import save_file

size, world_size, bucket, prefix, create = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1"
client = boto3.client("s3")
if create:
    client.create_bucket(Bucket=bucket)
generator = torch.Generator().manual_seed(0)
tensors = {f"h.{i}.weight": torch.randn(2048, 2048, generator=generator) for i in range(max(1, size // (16 << 20)))}
work = sys.argv[6]
save_file(tensors, f"{work}/model.safetensors", metadata={"format": "pt"})
del tensors
fsdpkit = [sys.executable, "-m", "fsdpkit_cli", "convert"]
subprocess.run([*fsdpkit, f"{work}/model.safetensors", f"{work}/sharded", "--to", "sharded", "--world-size", world_size], check=True)
Path(work, "model.safetensors").unlink()
subprocess.run([*fsdpkit, f"{work}/sharded", f"{work}/full", "--to", "full"], check=True, stdout=subprocess.DEVNULL)
total = 0
for path in sorted(Path(work, "sharded").iterdir()):
    client.upload_file(str(path), bucket, f"{prefix}/{path.name}")
    total += path.stat().st_size
print(total)
"""

TRANSFER = r"""
import sys, tempfile, boto3
from pathlib import Path
from boto3.s3.transfer import TransferConfig
client, bucket, prefix, full = boto3.client("s3"), sys.argv[1], sys.argv[2], Path(sys.argv[3])
config = TransferConfig(max_concurrency=10)
with tempfile.TemporaryDirectory() as work:
    for item in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]:
        client.download_file(bucket, item["Key"], f"{work}/{Path(item['Key']).name}", Config=config)
for path in sorted(full.iterdir()):
    client.upload_file(str(path), bucket, f"bench/out-boto3/{path.name}", Config=config)
"""


def _timed(command: list[str], env: dict[str, str]) -> tuple[float, int, float]:
    """(seconds, peak RSS bytes, CPU seconds) of one process."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{' '.join(command[:4])} failed (status {status})")
    return seconds, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


def _compiled_env(work: str) -> dict[str, str]:
    """The environment of the timed commands: bytecode cached under `work` (an installed package
    has its bytecode compiled, as boto3's is; with PYTHONDONTWRITEBYTECODE set, fsdpkit's own
    modules alone would be compiled again in every run)."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPYCACHEPREFIX": f"{work}/bytecode"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256MB", help="checkpoint bytes (default 256MB)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--bucket", default="fsdpkit-bench")
    parser.add_argument("--only", choices=("verify", "convert"), help="time these rows alone")
    parser.add_argument("--baseline", type=Path, help="another fsdpkit checkout whose convert is timed in the same rounds")
    args = parser.parse_args()
    server = None
    if not os.environ.get("AWS_ENDPOINT_URL"):
        server, endpoint = _start_moto()
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
        )
    try:
        _run(args)
    finally:
        if server is not None:
            server.kill()
            server.wait()


def _run(args: argparse.Namespace) -> None:
    """The setup runs in a process of its own, so this one stays small: a child's peak RSS
    counts the memory it shared with this process before it started its program."""
    server_is_local = "127.0.0.1" in os.environ["AWS_ENDPOINT_URL"]
    prefix, url = "bench/run", f"s3://{args.bucket}/bench"
    with tempfile.TemporaryDirectory() as work:
        setup = [
            sys.executable,
            "-c",
            SETUP,
            str(parse_size(args.size)),
            str(args.world_size),
            args.bucket,
            prefix,
            str(int(server_is_local)),
        ]
        total = int(subprocess.run([*setup, work], check=True, capture_output=True, text=True).stdout.split()[-1])
        commands: dict[str, list[str]] = {}
        if args.only != "convert":
            commands |= {"fsdpkit verify s3://": [sys.executable, "-m", "fsdpkit_cli", "verify", f"{url}/run"]}
            commands |= {name: [sys.executable, "-c", code, args.bucket, prefix] for name, code in READERS.items()}
        env = _compiled_env(work)
        envs = {}
        if args.only != "verify":
            convert = [sys.executable, "-m", "fsdpkit_cli", "convert", f"{url}/run", f"{url}/out-fsdpkit", "--to", "full", "--overwrite"]
            commands |= {CONVERT: convert}
            if args.baseline is not None:
                commands |= {BASELINE: [*convert[:-2], f"{url}/out-baseline", "--to", "full", "--overwrite"]}
                envs[BASELINE] = _checkout_env(args.baseline.resolve(), work, env)
            commands |= {"boto3 download + upload": [sys.executable, "-c", TRANSFER, args.bucket, prefix, f"{work}/full"]}
        for name in commands:  # a round that compiles the bytecode, not counted
            if not name.startswith("boto3"):
                _timed(commands[name], envs.get(name, env))
        _report(args, commands, envs, env, total, server_is_local)


def _checkout_env(checkout: Path, work: str, env: dict[str, str]) -> dict[str, str]:
    """The environment that runs `checkout`'s fsdpkit and CLI (its `cli/` as `fsdpkit_cli`)."""
    shim = Path(work, "baseline-shim")
    shim.mkdir()
    (shim / "fsdpkit_cli").symlink_to(checkout / "cli")
    return {**env, "PYTHONPATH": f"{checkout}{os.pathsep}{shim}", "PYTHONPYCACHEPREFIX": f"{work}/bytecode-baseline"}


def _report(
    args: argparse.Namespace, commands: dict[str, list[str]], envs: dict[str, dict[str, str]], env: dict[str, str], total: int, local: bool
) -> None:
    runs: dict[str, list[tuple[float, int, float]]] = {name: [] for name in commands}
    load = os.getloadavg()[0]
    for _ in range(args.repeat):  # interleaved, so a slow moment of the machine falls on every reader alike
        for name, command in commands.items():
            runs[name].append(_timed(command, envs.get(name, env)))
    where = "moto's server, this machine" if local else os.environ["AWS_ENDPOINT_URL"]
    print(f"{format_size(total)} in {args.world_size} rank files on {where}; median of {args.repeat}")
    print(f"load average (1 min) {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} CPUs")
    medians = {name: statistics.median(t for t, _, _ in found) for name, found in runs.items()}
    for name, found in runs.items():
        seconds, cpu = medians[name], statistics.median(c for _, _, c in found)
        rss = format_size(max(r for _, r, _ in found))
        print(f"{name:30} {seconds:7.2f} s  {total / seconds / 1e6:8.1f} MB/s  CPU {cpu:5.2f} s  peak RSS {rss}")
    if "fsdpkit verify s3://" in runs:
        fastest = min(READERS, key=lambda name: medians[name])
        _ratio("verify / the faster boto3 reader", runs["fsdpkit verify s3://"], runs[fastest])
    for name in (CONVERT, BASELINE):
        if name in runs:
            _ratio(f"{name.removeprefix('fsdpkit ')} / boto3 download + upload", runs[name], runs["boto3 download + upload"])


def _ratio(what: str, runs: list[tuple[float, int, float]], against: list[tuple[float, int, float]]) -> None:
    """The ratio of the medians, and its spread round by round."""
    rounds = [a / b for (a, _, _), (b, _, _) in zip(runs, against, strict=True)]
    median = statistics.median(t for t, _, _ in runs) / statistics.median(t for t, _, _ in against)
    print(f"{what}: {median:.2f}x (round by round {min(rounds):.2f}x to {max(rounds):.2f}x)")


if __name__ == "__main__":
    main()
