"""Peak RSS of every process of a spread conversion, measured from outside: `convert --to full
--dtype bf16` of an fp32 fsdpkit checkpoint, run three ways on this machine:

    .venv/bin/python benchmarks/spread_rss.py                 # 1 GiB of fp32 weights
    .venv/bin/python benchmarks/spread_rss.py --gib 0.5 --json

- `nodes`: two nodes of two processes on loopback (fsdpkit's --nnodes 2 --node-rank 0/1
  --master-addr 127.0.0.1 --master-port P: two commands at once),
- `torchrun`: `torchrun --standalone --nproc-per-node 2 -m fsdpkit_cli convert ...`,
- `one_node`: `--nproc-per-node 2`.

The source is made as benchmarks/spread_speedup.py makes it (64 MiB tensors), so the copy's
buffers and mapped windows reach their bounds. While a run goes, every process of its trees is
sampled every 0.1 s: its VmHWM (the kernel's peak RSS of the process) and whether libtorch is
mapped in it (it imported torch). Reported per process: its command line (shortened), peak RSS
in MB and torch; and the spread ranks' own figures from --json (`peak_rss_bytes`, `torch`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spread_speedup import make_source, weight_bytes_of  # noqa: E402

FLAGS = ["--to", "full", "--dtype", "bf16", "--max-shard-size", "128MB", "--json"]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(_children(current))
    return out


def _sample(pid: int) -> tuple[str, int, bool] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        maps = Path(f"/proc/{pid}/maps").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None
    hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    return cmdline, hwm, "libtorch_cpu" in maps


def run_sampled(commands: list[list[str]]) -> tuple[list[dict], list[str]]:
    """Run `commands` at once; every process of their trees: its peak RSS and whether it mapped libtorch."""
    started = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for c in commands]
    seen: dict[int, tuple[str, int, bool]] = {}
    while any(p.poll() is None for p in started):
        for process in started:
            for pid in _tree(process.pid):
                sample = _sample(pid)
                if sample is not None and sample[1] >= seen.get(pid, ("", 0, False))[1]:
                    seen[pid] = (sample[0], sample[1], sample[2] or seen.get(pid, ("", 0, False))[2])
        time.sleep(0.1)
    outputs = [p.communicate()[0] for p in started]
    codes = [p.returncode for p in started]
    if any(codes):
        raise SystemExit(f"a run failed: exit codes {codes}")
    rows = [{"command": _short(cmd), "peak_rss_mb": round(hwm / 1024, 1), "torch": torch} for cmd, hwm, torch in seen.values()]
    return sorted(rows, key=lambda row: -row["peak_rss_mb"]), outputs


def _short(cmdline: str) -> str:
    words = cmdline.split()
    keep = [w for w in words if not w.startswith("/") or w.endswith("python") or "python3" in w]
    return " ".join(Path(w).name if w.startswith("/") else w for w in keep)[:120]


def _ranks(outputs: list[str]) -> list[dict]:
    for text in outputs:
        text = text.strip()
        if text.startswith("{"):
            spread = json.loads(text).get("spread", {})
            return [{k: r.get(k) for k in ("rank", "host", "peak_rss_bytes", "torch")} for r in spread.get("ranks", [])]
    return []


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def layers_for(gib: float) -> int:
    """The number of GPT-2-large blocks whose fp32 weights come nearest `gib` GiB (at least one)."""
    per_block = weight_bytes_of(1) - weight_bytes_of(0)
    return max(1, round((gib * 2**30 - weight_bytes_of(0)) / per_block))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--only", choices=["nodes", "torchrun", "one_node"], nargs="+", default=["nodes", "torchrun", "one_node"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result: dict = {"gib": args.gib, "load_average_before": [round(x, 2) for x in os.getloadavg()]}
    with tempfile.TemporaryDirectory(prefix="fsdpkit-rss-", dir=os.environ.get("TMPDIR")) as tmp:
        saved = os.dup(1)
        os.dup2(2, 1)  # making the source prints its own report: to stderr
        try:
            source, _ = make_source(Path(tmp), layers_for(args.gib))
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        cli = [sys.executable, "-m", "fsdpkit_cli", "convert", str(source)]
        port = _port()
        runs = {
            "nodes": [
                [*cli, f"{tmp}/nodes", *FLAGS, "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", str(node)]
                + ["--master-addr", "127.0.0.1", "--master-port", str(port)]
                for node in (0, 1)
            ],
            "torchrun": [
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "fsdpkit_cli"]
                + ["convert", str(source), f"{tmp}/torchrun", *FLAGS]
            ],
            "one_node": [[*cli, f"{tmp}/one", *FLAGS, "--nproc-per-node", "2"]],
        }
        for name in args.only:
            rows, outputs = run_sampled(runs[name])
            result[name] = {"processes": rows, "ranks_json": _ranks(outputs)}
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
