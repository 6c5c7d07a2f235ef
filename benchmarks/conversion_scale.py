"""The plan of a 405B DeepSpeed ZeRO-3 + Adam checkpoint -> Hugging Face safetensors (bf16,
5 GB files) spread over 1, 8 and 64 nodes of 8 processes, from synthetic metadata (no data):

    .venv/bin/python benchmarks/conversion_scale.py                  # the table in docs/distributed-conversion.md
    .venv/bin/python benchmarks/conversion_scale.py --json

The model is Llama-3.1-405B's shapes (126 layers, hidden 16384, GQA 128/8 heads, MLP 53248,
vocabulary 128256, untied embeddings). The source holds fp32 master weights and Adam's two
moments (12 bytes a parameter, ~4.9 TB) in ZeRO-3 partitions; `convert --to full --dtype bf16`
reads the fp32 weights only (4 bytes a parameter) and writes 2. The output files are what
`split_into_files` makes of that tensor list; `make_plan` (the one the commands use) shares
them out, cutting files where a share would be too large. Predicted time: every process reads
at PROCESS_READ (the issue's one process at 1 GB/s) and a node at most at NODE_READ; writes
are left out (half the bytes of the reads). Memory per process: what
every process of the run builds, measured with tracemalloc on the real structures: the source's
table as the DeepSpeed reader builds it (`add_sources`, from synthetic rank files of SOURCE_RANKS
ranks: fp32 weights and Adam's two moments per parameter), `convert --to full`'s output (files,
headers, tensor map), the output files and the plan; then the copy's bounded buffers and the
mapped source windows at most; and the interpreter with fsdpkit's modules, measured here as the
RSS of a fresh process that imported the spread runner (with fsdpkit's own flags no rank, on any
node, imports torch; under torchrun each worker holds torch too, about 190 MB more).
Not counted: the rank files' unpickled state while they are open (the reader keeps rank 0's model
states file whole, of the others' only their step and frozen fragments, and the optimizer files'
states), since there are no rank files here.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import subprocess
import sys
import tracemalloc
from pathlib import Path

from fsdpkit.checkpoint.core.any_checkpoint import AnyCheckpoint
from fsdpkit.checkpoint.core.bytecopy import DEFAULT_CHUNK_SIZE
from fsdpkit.checkpoint.core.files import MAX_WINDOWS, WINDOW_BYTES
from fsdpkit.checkpoint.core.names import layout_header
from fsdpkit.checkpoint.core.request import ConvertRequest
from fsdpkit.checkpoint.deepspeed.table import DeepSpeedCheckpoint, add_sources
from fsdpkit.checkpoint.format.to_full import full_output
from fsdpkit.checkpoint.spread.jobs import safetensors_file
from fsdpkit.checkpoint.spread.plan import Plan, make_plan
from fsdpkit.checkpoint.spread.writes import BUFFER_BYTES
from fsdpkit.checkpoint.torchfile.savefile import TensorRange
from fsdpkit.checkpoint.torchfile.unpickler import StorageRef, TensorRecord

GB = 10**9
PROCESS_READ = 1 * GB  # bytes/s one process reads
NODE_READ = 8 * GB  # bytes/s one node reads at most (its disks' or network's share)
PER_NODE = 8
SOURCE_RANKS = 1024  # ranks the ZeRO-3 checkpoint was saved by
SOURCE_BYTES_PER_PARAM = 12  # fp32 weights + exp_avg + exp_avg_sq
READ_BYTES_PER_PARAM, OUT_BYTES_PER_PARAM = 4, 2


def llama_405b() -> list[tuple[str, str, tuple[int, ...]]]:
    hidden, layers, heads, kv_heads, mlp, vocab = 16384, 126, 128, 8, 53248, 128256
    kv = hidden // heads * kv_heads
    entries = [("model.embed_tokens.weight", "BF16", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        entries += [
            (f"{p}.input_layernorm.weight", "BF16", (hidden,)),
            (f"{p}.self_attn.q_proj.weight", "BF16", (hidden, hidden)),
            (f"{p}.self_attn.k_proj.weight", "BF16", (kv, hidden)),
            (f"{p}.self_attn.v_proj.weight", "BF16", (kv, hidden)),
            (f"{p}.self_attn.o_proj.weight", "BF16", (hidden, hidden)),
            (f"{p}.post_attention_layernorm.weight", "BF16", (hidden,)),
            (f"{p}.mlp.gate_proj.weight", "BF16", (mlp, hidden)),
            (f"{p}.mlp.up_proj.weight", "BF16", (mlp, hidden)),
            (f"{p}.mlp.down_proj.weight", "BF16", (hidden, mlp)),
        ]
    return entries + [("model.norm.weight", "BF16", (hidden,)), ("lm_head.weight", "BF16", (vocab, hidden))]


class RankFile:
    """What the DeepSpeed reader reads of one rank file: its path, its unpickled state, where a tensor lies."""

    def __init__(self, path: Path, state: dict):
        self.path, self.state = path, state

    def tensor_range(self, record: TensorRecord, what: str) -> TensorRange:
        return TensorRange(self.path, 4096 + record.storage_offset * 4, math.prod(record.shape), "F32")


def _flat(numel: int, at: int) -> TensorRecord:
    return TensorRecord(StorageRef(None, "0", numel), at, (numel,), (1,), "F32")  # type: ignore[arg-type]


def zero3_source(entries: list[tuple[str, str, tuple[int, ...]]], ranks: int) -> AnyCheckpoint:
    """The table the DeepSpeed reader builds of a ZeRO-3 + Adam checkpoint of `ranks` ranks, as
    convert opens it (synthetic rank files: no data)."""
    shapes = {name: shape for name, _, shape in entries}
    per_rank = sum(math.ceil(math.prod(shape) / ranks) for shape in shapes.values())
    model = {"module": {}, "buffer_names": [], "param_shapes": [shapes], "shared_params": {}}
    models = [RankFile(Path(f"/ckpt/global_step1000/zero_pp_rank_{r}_mp_rank_00_model_states.pt"), model) for r in range(ranks)]
    optims = [RankFile(Path(f"/ckpt/global_step1000/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"), {}) for r in range(ranks)]
    moments = [{"exp_avg": _flat(per_rank, per_rank), "exp_avg_sq": _flat(per_rank, 2 * per_rank)}]
    states = [{"fp32_flat_groups": [_flat(per_rank, 0)], "base_optimizer_state": moments} for _ in range(ranks)]
    checkpoint = DeepSpeedCheckpoint(None, 3, ranks, "F32", "0.16.0", None)  # type: ignore[arg-type]
    add_sources(checkpoint, models, optims, states)  # type: ignore[arg-type]
    return AnyCheckpoint("/ckpt", {t.name: t for t in checkpoint.model}, {t.name: t for t in checkpoint.optimizer}, full_dtype="F32")


def every_process_holds(entries: list[tuple[str, str, tuple[int, ...]]], ranks: int, world_size: int) -> tuple[list, int]:
    """(the output files, the bytes of what every process builds before it copies: the source's
    table, convert's output, the files' headers, the plan), measured with tracemalloc."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        opened = zero3_source(entries, ranks)
        output = full_output(opened, ConvertRequest("full", max_shard_size=5 * GB, cast_to="BF16"))
        layouts = [layout_header(group, metadata) for _, group, metadata in output.files]
        files = [
            safetensors_file(name, header, order, whole=set(), splittable=True)
            for (name, _, _), (header, order) in zip(output.files, layouts, strict=True)
        ]
        plan = Plan.from_json(make_plan(files, world_size).to_json())
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del opened, output, layouts, plan
    return files, used


def interpreter_mb() -> float:
    """RSS of a fresh process that imported the spread runner (what a worker starts with)."""
    code = "import fsdpkit.checkpoint.spread.runner, re; print(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1))"
    return int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout) / 1024


def rows(layouts: list[tuple[int, int]]) -> list[dict]:
    """One row per (nodes, processes per node)."""
    entries = llama_405b()
    params = sum(_numel(shape) for _, _, shape in entries)
    buffers_mb = (2 * DEFAULT_CHUNK_SIZE + BUFFER_BYTES) / 2**20
    windows_mb = 2 * MAX_WINDOWS * WINDOW_BYTES / 2**20
    base_mb = interpreter_mb()
    out = []
    scale = READ_BYTES_PER_PARAM / OUT_BYTES_PER_PARAM
    for nodes, per_node in layouts:
        files, held = every_process_holds(entries, SOURCE_RANKS, nodes * per_node)
        plan = make_plan(files, nodes * per_node)
        shares = plan.rank_bytes()
        by_node = [shares[n * per_node : (n + 1) * per_node] for n in range(nodes)]
        seconds = max(max(max(mine) * scale / PROCESS_READ, sum(mine) * scale / NODE_READ) for mine in by_node)
        memory = {"interpreter": round(base_mb), "structures": round(held / 2**20, 1), "buffers": round(buffers_mb, 1)}
        memory |= {"mapped_windows_max": round(windows_mb), "total_max": round(base_mb + held / 2**20 + buffers_mb + windows_mb)}
        out.append(
            {
                "nodes": nodes,
                "processes": nodes * per_node,
                "params": params,
                "source_bytes": params * SOURCE_BYTES_PER_PARAM,
                "source_ranks": SOURCE_RANKS,
                "files": len(files),
                "parts": len(plan.parts),
                "output_bytes_per_node_max": max(map(sum, by_node)),
                "read_bytes_per_node_max": int(max(map(sum, by_node)) * scale),
                "largest_share_vs_mean": round(plan.imbalance, 3),
                "predicted_seconds": round(seconds),
                "memory_mb_per_process": memory,
            }
        )
    return out


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    table = rows([(1, 1), *((nodes, PER_NODE) for nodes in args.nodes)])
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    first = table[0]
    print(f"405B: {first['params'] / 1e9:.0f}B parameters, source {first['source_bytes'] / 1e12:.2f} TB, {first['files']} output files")
    print("| nodes x processes | parts | largest share / mean | read per node | written per node | predicted | memory per process |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in table:
        memory = row["memory_mb_per_process"]
        nodes, share = row["nodes"], row["largest_share_vs_mean"]
        read, written = row["read_bytes_per_node_max"] / 1e9, row["output_bytes_per_node_max"] / 1e9
        mem = (
            f"<= {memory['total_max']} MB: {memory['interpreter']} interpreter + {memory['structures']} table, output and plan "
            f"+ {memory['buffers']} buffers + <= {memory['mapped_windows_max']} mapped"
        )
        print(
            f"| {nodes} x {row['processes'] // nodes} | {row['parts']} | {share:.3f} | {read:,.0f} GB | {written:,.0f} GB "
            f"| {row['predicted_seconds'] / 60:.1f} min | {mem} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
