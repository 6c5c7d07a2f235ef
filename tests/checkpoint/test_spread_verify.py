"""`verify` spread over 1 and 2 processes prints what the one-process verify prints, for a DCP
checkpoint written by torch's `dcp.save` and a full one written by transformers'
`save_pretrained`; a changed byte gives the same one error line and exit 3 (DeepSpeed's, verl's
and Megatron's, written by those tools, in their own test modules)."""

from __future__ import annotations

import json
import warnings

import torch
from support.checkpoint_files import run_cli
from support.spread_verify import assert_spread_verify_is_one_process, storage_offset


def test_dcp_written_by_torch(tmp_path):
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(20 + i, 16, generator=g) for i in range(6)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: torch saves as rank 0 of 1
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp"), thread_count=3))
    line = assert_spread_verify_is_one_process(tmp_path / "dcp", tmp_path / "dcp" / "__0_1.distcp", 28)
    assert "not a readable pickle" in line


def test_full_written_by_transformers(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    files = sorted((tmp_path / "hf").glob("*.safetensors"))
    assert len(files) >= 2
    line = assert_spread_verify_is_one_process(tmp_path / "hf", files[1], 9)  # a byte of its JSON header
    assert files[1].name in line


def test_one_torch_save_file_cut_between_ranks_where_storages_start(tmp_path):
    """A rank's file as verl writes it (torch.save), one file for two processes: cut where its
    storages start; two damaged storages, found by different ranks, listed in the one-process order."""
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "verl" / "model_world_size_1_rank_0.pt"
    path.parent.mkdir()
    torch.save({f"layer.{i}.weight": torch.randn(64, 64, generator=g) for i in range(8)}, path)
    planned = run_cli("verify", path.parent, "--nproc-per-node", "2", "--dry-run", "--json")
    assert all(len(rank["parts"]) > 1 for rank in json.loads(planned.stdout)["ranks"]), planned.stdout
    data = bytearray(path.read_bytes())
    for key in ("6", "1"):
        data[storage_offset(path, key)] ^= 0xFF
    path.write_bytes(bytes(data))
    one = run_cli("verify", path.parent, "--json")
    spread = run_cli("verify", path.parent, "--json", "--nproc-per-node", "2")
    assert one.exit_code == spread.exit_code == 3
    report, spread_report = json.loads(one.stdout), json.loads(spread.stdout)
    assert len(report["problems"]) == 2 and "'1'" in report["problems"][0] and "'6'" in report["problems"][1]
    assert spread_report.pop("spread")["world_size"] == 2 and spread_report == report
