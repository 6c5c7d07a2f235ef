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
are left out (half the bytes of the reads). Memory per process: the copy's bounded buffers,
the mapped source windows at most, and the source's piece table (ZeRO-3 cuts every parameter
over every source rank: tensors x SOURCE_RANKS pieces, each costing what tracemalloc measures
here), which every process holds; the interpreter itself (with torch, for gloo) is measured
by the CPU benchmark, not here.
"""

from __future__ import annotations

import argparse
import json
import tracemalloc
from pathlib import Path

from fsdpkit.checkpoint.core.bytecopy import DEFAULT_CHUNK_SIZE, SourcePiece
from fsdpkit.checkpoint.core.files import MAX_WINDOWS, WINDOW_BYTES
from fsdpkit.checkpoint.core.names import layout_header
from fsdpkit.checkpoint.format.to_full import split_into_files
from fsdpkit.checkpoint.spread.jobs import safetensors_file
from fsdpkit.checkpoint.spread.plan import make_plan
from fsdpkit.checkpoint.spread.writes import BUFFER_BYTES
from fsdpkit.flat_layout import ElementRange

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


def piece_bytes() -> float:
    """Python bytes one source piece of the table costs (measured on 20000 of them)."""
    tracemalloc.start()
    path = Path("/checkpoint/global_step1000/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    before = tracemalloc.get_traced_memory()[0]
    pieces = [
        SourcePiece(ElementRange(i * 1000, i * 1000 + 1000), path, 4096 + i * 4000, 4000, 0x1234, f"layer.{i}.w") for i in range(20000)
    ]
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del pieces
    return used / 20000


def rows(layouts: list[tuple[int, int]]) -> list[dict]:
    """One row per (nodes, processes per node)."""
    entries = llama_405b()
    params = sum(_numel(shape) for _, _, shape in entries)
    files = []
    for name, group in split_into_files(entries, prefix="model", max_shard_size=5 * GB):
        header, order = layout_header(group, {"format": "pt"})
        files.append(safetensors_file(name, header, order, whole=set(), splittable=True))
    table_mb = len(entries) * SOURCE_RANKS * piece_bytes() / 2**20
    buffers_mb = (2 * DEFAULT_CHUNK_SIZE + BUFFER_BYTES) / 2**20
    windows_mb = 2 * MAX_WINDOWS * WINDOW_BYTES / 2**20
    out = []
    scale = READ_BYTES_PER_PARAM / OUT_BYTES_PER_PARAM
    for nodes, per_node in layouts:
        plan = make_plan(files, nodes * per_node)
        shares = plan.rank_bytes()
        by_node = [shares[n * per_node : (n + 1) * per_node] for n in range(nodes)]
        seconds = max(max(max(mine) * scale / PROCESS_READ, sum(mine) * scale / NODE_READ) for mine in by_node)
        out.append(
            {
                "nodes": nodes,
                "processes": nodes * per_node,
                "params": params,
                "source_bytes": params * SOURCE_BYTES_PER_PARAM,
                "files": len(files),
                "parts": len(plan.parts),
                "output_bytes_per_node_max": max(map(sum, by_node)),
                "read_bytes_per_node_max": int(max(map(sum, by_node)) * scale),
                "largest_share_vs_mean": round(plan.imbalance, 3),
                "predicted_seconds": round(seconds),
                "memory_mb_per_process": {
                    "buffers": round(buffers_mb, 1),
                    "mapped_windows_max": round(windows_mb),
                    "piece_table": round(table_mb),
                },
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
        mem = f"{memory['buffers']} MB buffers + <= {memory['mapped_windows_max']} MB mapped + {memory['piece_table']} MB table"
        print(
            f"| {nodes} x {row['processes'] // nodes} | {row['parts']} | {share:.3f} | {read:,.0f} GB | {written:,.0f} GB "
            f"| {row['predicted_seconds'] / 60:.1f} min | {mem} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
