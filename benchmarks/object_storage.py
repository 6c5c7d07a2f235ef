"""Object-storage benchmark: `fsdpkit verify s3://` and `fsdpkit convert s3:// s3://` against
boto3 moving the same objects on the same server, side by side in one run.

    .venv/bin/python benchmarks/object_storage.py                 # gpt2 + AdamW (1.5 GB), moto's server
    .venv/bin/python benchmarks/object_storage.py --size 256MB    # a quick run: 2048x2048 layers + AdamW
    AWS_ENDPOINT_URL=... .venv/bin/python benchmarks/object_storage.py --bucket my-bench-bucket   # a real store

Makes a checkpoint of --model's layer shapes (default gpt2: GPT-2 small, 124M parameters) with
random fp32 weights and their AdamW state (exp_avg, exp_avg_sq, step): about 1.5 GB. It is
written in fsdpkit's sharded format at --world-size rank files, converted locally `--to
deepspeed --stage 3` at --ds-world-size ranks (DeepSpeed's own layout: its zero_to_fp32 reads
it in the tests) and from there `--to full`, and both checkpoints are uploaded with boto3. Then
it times, each in its own process (peak RSS and CPU time from wait4), interleaved rounds
after one that compiles the bytecode (--repeat of the verify rows; --convert-repeat of the
convert rows, default 1, since gpt2's convert takes minutes a round on moto; without --size
the convert rows get no compiling round, which costs them a second or two of minutes):

- fsdpkit verify s3://.../run  (the fsdpkit checkpoint: every fragment's crc32 as the bytes stream in)
- boto3 download_fileobj       (max_concurrency=10, into a sink that keeps nothing)
- boto3 get_object             (one streamed GET per object, read in 8 MB pieces)
- fsdpkit convert s3://.../ds s3://.../out --to full
                               (DeepSpeed ZeRO-3 to full safetensors: the model's weights, as an
                               HF checkpoint holds them; the optimizer state is not converted)
- boto3 download_file + upload (download_file of all the DeepSpeed checkpoint's objects,
                               max_concurrency=10, then upload_file of the full output, made
                               locally beforehand)
- boto3 get_object + upload    (the same, each object downloaded by one streamed GET)

and prints the median time, CPU and peak RSS of each, and the median and spread of the round-by-
round ratios of verify to the faster boto3 reader and of convert to the faster boto3 transfer.
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

VERIFY = "fsdpkit verify s3://"
CONVERT = "fsdpkit convert s3:// s3://"
TRANSFERS = {"boto3 download_file + upload": "download_file", "boto3 get_object + upload": "get_object"}
BASELINE = "fsdpkit convert (--baseline)"
READERS = {
    "boto3 download_fileobj": r"""
import sys, boto3
from boto3.s3.transfer import TransferConfig
class Sink:
    def write(self, data): return len(data)
client, bucket, prefix = boto3.client("s3"), sys.argv[1], sys.argv[2]
config = TransferConfig(max_concurrency=10)
for item in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]:
    client.download_fileobj(bucket, item["Key"], Sink(), Config=config)
""",
    "boto3 get_object": r"""
import sys, boto3
client, bucket, prefix = boto3.client("s3"), sys.argv[1], sys.argv[2]
for item in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]:
    body = client.get_object(Bucket=bucket, Key=item["Key"])["Body"]
    while body.read(8 << 20):
        pass
""",
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_moto(log: Path | None = None) -> tuple[subprocess.Popen, str]:
    """moto's server on a free port of 127.0.0.1; its request log (one line a request) into `log` where given."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL if log is None else log.open("ab"),
    )
    for _ in range(100):
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return server, f"http://127.0.0.1:{port}"
        time.sleep(0.1)
    server.kill()
    raise SystemExit("moto's server did not start")


SETUP = r"""
import subprocess, sys, torch
from pathlib import Path
import boto3
from fsdpkit.checkpoint.format import storage
from fsdpkit.checkpoint.format.manifest import Manifest
from fsdpkit.checkpoint.format.placement import Placement, TensorSpec
from fsdpkit.checkpoint.live.save_protocol import write_rank
from fsdpkit.flat_layout import ElementRange
from fsdpkit.models.units import placement_for_model

model, size, world, ds_world, bucket, create, work, only = sys.argv[1:9]
world, size, work = int(world), int(size), Path(work)
if model:
    placement = placement_for_model(model)
else:  # --size: fp32 2048x2048 layers with their two AdamW moments, `size` bytes in all
    placement = Placement.flat([[(f"h.{i}.weight", (2048, 2048))] for i in range(max(1, size // (3 * 16 << 20)))])
params = [(n, s) for unit in placement.units for n, s in unit]
table = [TensorSpec(n, "F32", s) for n, s in params]
table += [TensorSpec(f"optim.{k}.{n}", "F32", s) for k in ("exp_avg", "exp_avg_sq") for n, s in params]
table += [TensorSpec(f"optim.step.{n}", "F32", ()) for n, _ in params]
specs = {t.name: t for t in table}


class Generated(dict):
    # each tensor made when first asked for, whole, so memory stays about one tensor
    def __missing__(self, name):
        self.clear()
        spec = specs[name]
        g = torch.Generator().manual_seed(hash(name) % 2**31)
        data = torch.full((1,), 1000.0) if name.startswith("optim.step.") else torch.randn(max(spec.numel, 1), generator=g)[: spec.numel]
        if name.startswith("optim.exp_avg_sq."):
            data = data.abs_()
        self[name] = (ElementRange(0, spec.numel), data)
        return self[name]


manifest = Manifest(world, "full", placement, tuple(table), {}, {"step": 1000})
tmp = storage.begin(work / "sharded", 1000)
for rank in range(world):
    write_rank(tmp, manifest, rank, Generated())
storage.commit(tmp, work / "sharded", 1000, manifest)
fsdpkit = [sys.executable, "-m", "fsdpkit_cli", "convert"]
quiet = dict(check=True, stdout=subprocess.DEVNULL)
if only != "verify":
    subprocess.run([*fsdpkit, f"{work}/sharded", f"{work}/ds", "--to", "deepspeed", "--stage", "3", "--world-size", ds_world], **quiet)
    subprocess.run([*fsdpkit, f"{work}/ds", f"{work}/full", "--to", "full"], **quiet)
client = boto3.client("s3")
if create == "1":
    client.create_bucket(Bucket=bucket)
for local, prefix in (("sharded", "bench/run"), ("ds", "bench/ds")):
    total = 0
    if only and only != {"sharded": "verify", "ds": "convert"}[local]:
        print(0, 0)
        continue
    for path in sorted(p for p in (work / local).rglob("*") if p.is_file()):
        client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(work / local).as_posix()}")
        total += path.stat().st_size
    print(total, sum(1 for p in (work / local).rglob("*") if p.is_file()))
"""

TRANSFER = r"""
import shutil, sys, tempfile, boto3
from pathlib import Path
from boto3.s3.transfer import TransferConfig
client, bucket, prefix, full, how = boto3.client("s3"), sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
config = TransferConfig(max_concurrency=10)
with tempfile.TemporaryDirectory() as work:
    for item in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]:
        local = f"{work}/{item['Key'].replace('/', '_')}"
        if how == "download_file":
            client.download_file(bucket, item["Key"], local, Config=config)
        else:
            with open(local, "wb") as out:
                shutil.copyfileobj(client.get_object(Bucket=bucket, Key=item["Key"])["Body"], out, 8 << 20)
for path in sorted(p for p in full.rglob("*") if p.is_file()):
    client.upload_file(str(path), bucket, f"bench/out-boto3/{path.relative_to(full).as_posix()}", Config=config)
"""


def _timed(command: list[str], env: dict[str, str]) -> tuple[float, int, float]:
    """(seconds, peak RSS bytes, CPU seconds) of one process, run in the environment's scratch
    directory: `python -m` puts its working directory first on the path, which would run the
    fsdpkit found there instead of the checkout PYTHONPATH names."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=env, cwd=env["PYTHONPYCACHEPREFIX"])
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{' '.join(command[:4])} failed (status {status})")
    return seconds, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


def _compiled_env() -> dict[str, str]:
    """The environment of the timed commands, with their bytecode cached (an installed package
    has its bytecode compiled, as boto3's is; with PYTHONDONTWRITEBYTECODE set, fsdpkit's own
    modules alone would be compiled again in every run): see `_checkout_env`."""
    return {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="gpt2", help="model whose layer shapes the checkpoint has, with AdamW moments (default gpt2: 124M, 1.5 GB)"
    )
    parser.add_argument("--size", help="a quick run instead: 2048x2048 fp32 layers with their AdamW moments, this many bytes in all")
    parser.add_argument("--world-size", type=int, default=8, help="rank files of the fsdpkit checkpoint verify reads")
    parser.add_argument("--ds-world-size", type=int, default=2, help="ranks of the DeepSpeed ZeRO-3 checkpoint convert reads")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the verify rows")
    parser.add_argument(
        "--convert-repeat", type=int, default=1, help="rounds of the convert rows (default 1: gpt2's take minutes a round on moto)"
    )
    parser.add_argument("--bucket", default="fsdpkit-bench")
    parser.add_argument(
        "--no-compile-round", action="store_true", help="skip the uncounted first round (a long run: its bytecode compiling is noise)"
    )
    parser.add_argument("--only", choices=("verify", "convert"), help="time these rows alone")
    parser.add_argument("--baseline", type=Path, help="another fsdpkit checkout whose convert is timed in the same rounds")
    args = parser.parse_args()
    server, log = None, None
    with tempfile.TemporaryDirectory() as logs:
        if not os.environ.get("AWS_ENDPOINT_URL"):
            log = Path(logs, "moto.log")
            server, endpoint = start_moto(log)
            os.environ.update(
                AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
            )
        try:
            _run(args, log)
        finally:
            if server is not None:
                server.kill()
                server.wait()


def _run(args: argparse.Namespace, log: Path | None) -> None:
    """The setup runs in a process of its own, so this one stays small: a child's peak RSS
    counts the memory it shared with this process before it started its program."""
    server_is_local = "127.0.0.1" in os.environ["AWS_ENDPOINT_URL"]
    url = f"s3://{args.bucket}/bench"
    model = "" if args.size else args.model
    with tempfile.TemporaryDirectory() as work:
        setup = [sys.executable, "-c", SETUP, model, str(parse_size(args.size or "0")), str(args.world_size), str(args.ds_world_size)]
        print(f"setting up {args.model if model else args.size} + AdamW moments in {args.bucket} ...", file=sys.stderr, flush=True)
        found = subprocess.run(
            [*setup, args.bucket, str(int(server_is_local)), work, args.only or ""], check=True, capture_output=True, text=True
        )
        sizes = [tuple(int(v) for v in line.split()) for line in found.stdout.strip().splitlines()[-2:]]
        commands: dict[str, list[str]] = {}
        if args.only != "convert":
            commands |= {VERIFY: [sys.executable, "-m", "fsdpkit_cli", "verify", f"{url}/run"]}
            commands |= {name: [sys.executable, "-c", code, args.bucket, "bench/run"] for name, code in READERS.items()}
        env = _checkout_env(ROOT, work, _compiled_env(), "this")
        envs = {}
        if args.only != "verify":
            convert = [sys.executable, "-m", "fsdpkit_cli", "convert", f"{url}/ds", f"{url}/out-fsdpkit", "--to", "full", "--overwrite"]
            commands |= {CONVERT: convert}
            if args.baseline is not None:
                commands |= {BASELINE: [*convert[:-4], f"{url}/out-baseline", "--to", "full", "--overwrite"]}
                envs[BASELINE] = _checkout_env(args.baseline.resolve(), work, env, "baseline")
            transfer = [sys.executable, "-c", TRANSFER, args.bucket, "bench/ds", f"{work}/full"]
            commands |= {name: [*transfer, how] for name, how in TRANSFERS.items()}
        for name in commands:  # a round that compiles the bytecode, not counted
            long_convert = name in (CONVERT, BASELINE) and not args.size  # gpt2's: minutes a run on moto
            if not name.startswith("boto3") and not long_convert and not args.no_compile_round:
                _timed(commands[name], envs.get(name, env))
        _report(args, commands, envs, env, sizes, GetCounter(log, args.bucket))


def _checkout_env(checkout: Path, work: str, env: dict[str, str], label: str) -> dict[str, str]:
    """The environment that runs `checkout`'s fsdpkit and CLI (its `cli/` as `fsdpkit_cli`),
    its bytecode cached in a directory of its own (where its commands run, `_timed`)."""
    shim = Path(work, f"{label}-shim")
    shim.mkdir()
    (shim / "fsdpkit_cli").symlink_to(checkout / "cli")
    Path(work, f"bytecode-{label}").mkdir()
    return {**env, "PYTHONPATH": f"{checkout}{os.pathsep}{shim}", "PYTHONPYCACHEPREFIX": f"{work}/bytecode-{label}"}


class GetCounter:
    """GETs of the convert's source objects (bench/ds/...) that moto's request log shows
    between `start()` and `stop()`, by object: how many ranged GETs each command issued."""

    def __init__(self, log: Path | None, bucket: str):
        self.log, self.prefix, self.at = log, f"GET /{bucket}/bench/ds/", 0  # a 206's line is colored: no quote before it
        self.counts: dict[str, list[dict[str, int]]] = {}

    def start(self) -> None:
        self.at = self.log.stat().st_size if self.log is not None else 0

    def stop(self, name: str) -> None:
        if self.log is None:
            return
        with self.log.open("rb") as lines:
            lines.seek(self.at)
            found: dict[str, int] = {}
            for line in lines.read().decode(errors="replace").splitlines():
                if self.prefix in line:
                    key = line.split(self.prefix, 1)[1].split(" ", 1)[0].split("?", 1)[0]
                    found[key] = found.get(key, 0) + 1
        self.counts.setdefault(name, []).append(found)

    def line(self, name: str) -> str | None:
        """The median count per round: all GETs of the source, and those of its busiest object."""
        rounds = self.counts.get(name)
        if not rounds:
            return None
        total = statistics.median(sum(found.values()) for found in rounds)
        most = statistics.median(max(found.values(), default=0) for found in rounds)
        return f"{name:30} GETs of the source's objects: {total:.0f} in all, {most:.0f} of the busiest object (median of the rounds)"


def _report(
    args: argparse.Namespace,
    commands: dict[str, list[str]],
    envs: dict[str, dict[str, str]],
    env: dict[str, str],
    sizes: list[tuple[int, int]],
    gets: GetCounter,
) -> None:
    runs: dict[str, list[tuple[float, int, float]]] = {name: [] for name in commands}
    load = os.getloadavg()[0]
    rounds = {name: args.convert_repeat if name in (CONVERT, BASELINE, *TRANSFERS) else args.repeat for name in commands}
    for round_number in range(max(rounds.values())):  # interleaved, so a slow moment of the machine falls on every reader alike
        for name, command in commands.items():
            if round_number >= rounds[name]:
                continue
            gets.start()
            runs[name].append(_timed(command, envs.get(name, env)))
            gets.stop(name)
            seconds, rss, _ = runs[name][-1]
            print(f"round {round_number + 1}: {name} {seconds:.2f} s, peak RSS {format_size(rss)}", file=sys.stderr, flush=True)
    where = "moto's server, this machine" if gets.log is not None else os.environ["AWS_ENDPOINT_URL"]
    (sharded, sharded_files), (ds, ds_files) = sizes
    what = f"{args.model} + AdamW" if not args.size else f"{args.size} of 2048x2048 fp32 layers + AdamW"
    print(f"{what} on {where}; median of {args.repeat} interleaved rounds of verify, {args.convert_repeat} of convert")
    if args.only != "convert":
        print(f"verify reads fsdpkit's format: {format_size(sharded)} in {sharded_files} files, {args.world_size} rank files")
    if args.only != "verify":
        print(f"convert reads DeepSpeed ZeRO-3: {format_size(ds)} in {ds_files} files, {args.ds_world_size} ranks, to full (the weights)")
    print(f"load average (1 min) {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} CPUs")
    medians = {name: statistics.median(t for t, _, _ in found) for name, found in runs.items()}
    for name, found in runs.items():
        seconds, cpu = medians[name], statistics.median(c for _, _, c in found)
        total = sharded if name == VERIFY or name in READERS else ds
        rss = format_size(max(r for _, r, _ in found))
        print(f"{name:30} {seconds:7.2f} s  {total / seconds / 1e6:8.1f} MB/s of the source  CPU {cpu:5.2f} s  peak RSS {rss}")
    for name in (CONVERT, BASELINE, *TRANSFERS):
        counted = gets.line(name)
        if counted is not None:
            print(counted)
    if VERIFY in runs:
        fastest = min(READERS, key=lambda name: medians[name])
        _ratio(f"verify / the faster boto3 reader ({fastest})", runs[VERIFY], runs[fastest])
    if CONVERT in runs:
        transfer = min(TRANSFERS, key=lambda name: medians[name])
        for name in (CONVERT, BASELINE):
            if name in runs:
                _ratio(f"{name.removeprefix('fsdpkit ')} / the faster boto3 transfer ({transfer})", runs[name], runs[transfer])


def _ratio(what: str, runs: list[tuple[float, int, float]], against: list[tuple[float, int, float]]) -> None:
    """The median of the round-by-round ratios and their spread, and the ratio of the medians."""
    rounds = [a / b for (a, _, _), (b, _, _) in zip(runs, against, strict=True)]
    of_medians = statistics.median(t for t, _, _ in runs) / statistics.median(t for t, _, _ in against)
    print(
        f"{what}: {statistics.median(rounds):.2f}x, median of the rounds' ratios (spread {min(rounds):.2f}x to"
        f" {max(rounds):.2f}x; ratio of the medians {of_medians:.2f}x)"
    )


if __name__ == "__main__":
    main()
