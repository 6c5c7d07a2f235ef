"""Training on documents: jsonl, parquet shards and `datasets` directories, packed into windows
with an end-of-text token between documents, streamed shard by shard, resumed exactly.

The loader tests need no launch: their oracle is the documents' own UTF-8 bytes, each followed
by the end-of-text token, computed here from the Python strings. Two `fsdpkit train` launches
per source (jsonl packed in memory; 1 GB of parquet streamed) check exact resume against an
uninterrupted run computed in the same module; the two uninterrupted runs' peak memory is
compared.
"""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
import torch
from fsdpkit_cli.app import app
from typer.testing import CliRunner

from fsdpkit.checkpoint.live.tensors import CheckpointReader
from fsdpkit.data.documents import open_documents
from fsdpkit.data.packing import pack_corpus
from fsdpkit.data.streaming import RankStream, StreamPosition
from fsdpkit.data.tokens import ByteTokenizer
from fsdpkit.errors import DataCheckError, UsageError
from fsdpkit.train.data import TokenSource

pa = pytest.importorskip("pyarrow", reason="the [data] extra (make install installs it)")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

runner = CliRunner()
EOT = 255  # bytes, a 256-token vocabulary: vocab_size - 1


def corpus(count: int = 60, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "eta", "θeta"]
    return [f"doc {i}: " + " ".join(rng.choice(words, size=int(rng.integers(3, 30)))) for i in range(count)]


def packed_reference(texts: list[str]) -> np.ndarray:
    return np.concatenate([np.append(np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64), EOT) for t in texts])


def write_jsonl(path, texts: list[str], field: str = "text") -> None:
    path.write_text("".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")


def write_parquet_shards(directory, texts: list[str], shards: int) -> list:
    directory.mkdir(parents=True, exist_ok=True)
    size = -(-len(texts) // shards)
    paths = []
    for index in range(shards):
        path = directory / f"part-{index:03d}.parquet"
        part = texts[index * size : (index + 1) * size]
        pq.write_table(pa.table({"id": list(range(len(part))), "text": part}), path, row_group_size=7)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    texts = corpus()
    write_jsonl(root / "corpus.jsonl", texts)
    write_parquet_shards(root / "shards", texts, 3)
    datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))}).save_to_disk(str(root / "saved"))
    # A Hub dataset as huggingface_hub caches it: refs/main names the snapshot that holds the files.
    hub = root / "hub" / "datasets--someone--corpus"
    write_parquet_shards(hub / "snapshots" / ("0" * 40) / "data", texts, 2)
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text("0" * 40)
    return root, texts


@pytest.fixture
def hub_cache(sources, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(sources[0] / "hub"))


@pytest.mark.parametrize("spec", ["corpus.jsonl", "shards", "shards/part-*.parquet", "shards/part-001.parquet", "saved", "someone/corpus"])
def test_every_source_packs_its_documents_bytes_with_an_end_of_text_token_between(sources, hub_cache, spec):
    root, texts = sources
    documents = open_documents(spec if spec == "someone/corpus" else str(root / spec))
    packed = pack_corpus(documents, ByteTokenizer(), vocab_size=256)
    expected = texts[20:40] if spec.endswith("001.parquet") else texts
    assert np.array_equal(packed.tokens, packed_reference(expected))
    last = len(expected) - 1
    assert packed.where(len(packed.tokens) - 1) == {
        "shard": len(documents.shards) - 1,
        "shard_name": documents.shards[-1].name,
        "row": last % 20 if "shards" in spec else last % 30 if "corpus" in spec and "jsonl" not in spec else last,
        "token": len(expected[-1].encode("utf-8")),
    }


def test_packed_batches_are_windows_of_the_stream_in_a_seeded_order_each_epoch_and_the_same_for_jsonl_and_parquet(sources):
    root, texts = sources
    stream = packed_reference(texts)
    jsonl = TokenSource(str(root / "corpus.jsonl"), vocab_size=256, seq_len=31, seed=3)
    parquet = TokenSource(str(root / "shards"), vocab_size=256, seq_len=31, seed=3)
    windows = jsonl.order.count
    assert windows == int(len(stream) * 0.9) // 32
    seen = []
    for step in range(-(-2 * windows // 4)):
        batch = jsonl.global_batch(step, 4)
        assert torch.equal(batch, parquet.global_batch(step, 4))
        for row in batch.numpy():
            start = next(i for i in range(0, windows * 32, 32) if np.array_equal(stream[i : i + 32], row))
            seen.append(start // 32)
    first, second = seen[:windows], seen[windows : 2 * windows]
    assert sorted(first) == list(range(windows)) and sorted(second) == list(range(windows)) and first != second
    position = jsonl.position(5, 4)
    window = first[20]
    where = jsonl.corpus.where(window * 32)
    assert position == {"kind": "packed", "seed": 3, "epoch": 0, "window": 20, "windows": windows, **where}
    jsonl.check_position(5, 4, position)
    with pytest.raises(DataCheckError, match="the data changed"):
        TokenSource(str(root / "corpus.jsonl"), vocab_size=256, seq_len=31, seed=4).check_position(5, 4, position)


def _jsonl(path, lines: list[str]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


@pytest.fixture
def refused(monkeypatch):
    """`fsdpkit train` with bad data: (exit code, its one stderr line), no worker launched."""

    def no_launch(*args, **kwargs):
        raise AssertionError("a worker was launched")

    monkeypatch.setattr("fsdpkit.train.launcher.launch", no_launch)

    def run(data: str, *options: str) -> tuple[int, str]:
        common = ["--model", "gpt-tiny", "--seq-len", "15", "--global-batch-size", "8", "--nproc-per-node", "2"]
        result = runner.invoke(app, ["train", *common, "--data", data, *options])
        lines = result.stderr.strip().splitlines()
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        assert len(lines) == 1 and lines[0].startswith("error: "), result.output
        return result.exit_code, lines[0]

    return run


def test_bad_documents_are_one_line_and_exit_3_before_any_worker_starts(tmp_path, sources, refused):
    root, _ = sources
    corrupt = tmp_path / "corrupt"
    paths = write_parquet_shards(corrupt, corpus(), 2)
    paths[1].write_bytes(paths[1].read_bytes()[:100])
    short = json.dumps({"text": "x" * 100})
    cases = {
        "holds no documents": _jsonl(tmp_path / "empty.jsonl", []),
        "bad.jsonl line 2 is not JSON": _jsonl(tmp_path / "bad.jsonl", ['{"text": "a"}', "{oops", '{"text": "b"}']),
        "no text field 'text'; its fields: id, body": _jsonl(tmp_path / "body.jsonl", ['{"id": 1, "body": "a"}']),
        f"parquet shard {paths[1]} cannot be read": str(corrupt),
        "fewer than one global batch of 8": _jsonl(tmp_path / "short.jsonl", [short]),
    }
    for expected, data in cases.items():
        code, line = refused(data)
        assert code == 3 and expected in line, (expected, line)
    for data, field, expected in [
        (str(root / "corpus.jsonl"), "id", "field 'id' is int, not text"),
        (str(root / "shards"), "body", "its fields: id, text"),
        (str(root / "shards"), "id", "field 'id' is int64, not text"),
        (str(root / "saved"), "n", "field 'n' is int64, not text"),
    ]:
        code, line = refused(data, "--text-field", field)
        assert code == 3 and expected in line, (data, field, line)
    code, line = refused("no-such-user/no-such-dataset")
    assert code == 2 and "no Hub dataset of that name in the local cache" in line


def test_bad_streamed_documents_are_one_line_before_any_worker_starts(tmp_path, refused):
    """Streamed, each rank's first global batch is read before launch: an empty rank, a bad line
    or shard, or too few tokens for a rank's rows of one batch are found there."""
    short = json.dumps({"text": "x" * 40})
    corrupt = write_parquet_shards(tmp_path / "corrupt", corpus(), 2)
    corrupt[1].write_bytes(corrupt[1].read_bytes()[:100])
    for name, first, second in [("empty", [], []), ("bad", [short] * 4, ["{oops"]), ("short", [short] * 4, [short])]:
        _jsonl(tmp_path / name / "a.jsonl", first)
        _jsonl(tmp_path / name / "b.jsonl", second)
    cases = {
        "empty": f"the shards of rank 0 ({tmp_path / 'empty' / 'a.jsonl'}) hold no documents",
        "bad": f"{tmp_path / 'bad' / 'b.jsonl'} line 1 is not JSON",
        "corrupt": f"parquet shard {corrupt[1]} cannot be read",
        "short": f"the shards of rank 1 ({tmp_path / 'short' / 'b.jsonl'}) hold fewer than its 4 sequences of 16 tokens",
    }
    for name, expected in cases.items():
        code, line = refused(str(tmp_path / name), "--data-streaming")
        assert code == 3 and expected in line, (expected, line)
    code, line = refused(str(tmp_path / "bad" / "a.jsonl"), "--data-streaming")
    assert code == 2 and "1 shard(s), fewer than the 2 ranks" in line


def test_a_stream_reads_only_its_ranks_shards_and_a_stream_started_from_a_position_continues_exactly(tmp_path):
    texts = corpus(90, seed=1)
    write_parquet_shards(tmp_path / "shards", texts, 6)
    documents = open_documents(str(tmp_path / "shards"))
    for rank in (0, 1):
        stream = RankStream(documents, ByteTokenizer(), EOT, length=16, rank=rank, world_size=2)
        mine = packed_reference([t for shard in (rank, rank + 2, rank + 4) for t in texts[shard * 15 : (shard + 1) * 15]])
        windows = len(mine) // 16
        rows, _ = stream.next_rows(windows)
        assert np.array_equal(rows.reshape(-1), mine[: windows * 16])
    whole = RankStream(documents, ByteTokenizer(), EOT, length=16, rank=1, world_size=2)
    first, middle = whole.next_rows(37)
    assert middle.token > 0  # the cut is inside a document
    continued, end = whole.next_rows(windows)  # past the end of the epoch
    assert end.epoch == 1
    again = RankStream(documents, ByteTokenizer(), EOT, length=16, rank=1, world_size=2, start=StreamPosition.from_json(middle.to_json()))
    resumed, resumed_end = again.next_rows(windows)
    assert np.array_equal(resumed, continued) and resumed_end == end
    # a cut at a document's end: a stream started there goes on with the next document
    boundary = RankStream(documents, ByteTokenizer(), EOT, length=16, rank=1, world_size=2)
    cut = next(at for _ in range(windows) if (at := boundary.next_rows(1)[1]).token == 0)
    after, _ = boundary.next_rows(windows)
    again = RankStream(documents, ByteTokenizer(), EOT, length=16, rank=1, world_size=2, start=StreamPosition.from_json(cut.to_json()))
    assert np.array_equal(again.next_rows(windows)[0], after)
    with pytest.raises(UsageError, match="fewer than the 8 ranks"):
        RankStream(documents, ByteTokenizer(), EOT, length=16, rank=0, world_size=8)


def test_a_streams_memory_does_not_grow_with_the_dataset(tmp_path):
    """Memory that does not grow over a whole epoch: Python's allocation peak (numpy's arrays
    included) while streaming all of 0.5 MB and of 4 MB of jsonl (the 1 GB training run below
    reads only its first batches)."""

    def peak(megabytes: float) -> int:
        path = tmp_path / f"{megabytes}.jsonl"
        line = json.dumps({"text": "y" * 4000}) + "\n"
        path.write_text(line * int(megabytes * 1_000_000 // len(line)))
        stream = RankStream(open_documents(str(path)), ByteTokenizer(), EOT, length=257, rank=0, world_size=1)
        tracemalloc.start()
        try:
            while stream.position.epoch == 0:
                stream.next_rows(8)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, large = peak(0.5), peak(4)
    assert large < small + 256 * 1024, (small, large)


def train(*args: str) -> dict:
    result = runner.invoke(app, ["train", "--model", "gpt-tiny", "--seq-len", "31", "--global-batch-size", "4", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def weights(path) -> dict[str, torch.Tensor]:
    with CheckpointReader(path) as reader:
        return {name: reader.read_tensor(name) for name in reader.tensor_names()}


FULL_RUN = ["--steps", "4", "--save-every", "2", "--nproc-per-node", "2"]
GIGABYTE = "gigabyte"  # the streamed source: 1 GB of text in parquet shards


def gigabyte_of_parquet(directory, shards: int = 10) -> None:
    """`shards` hard links to one parquet file of 100 MB of text (25,000 documents of 4,000
    characters in row groups of 500, as a real corpus keeps them)."""
    directory.mkdir()
    rng = np.random.default_rng(0)
    words = np.array(["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"])
    base = " ".join(rng.choice(words, size=2000))[:3990]
    first = directory / "part-000.parquet"
    with pq.ParquetWriter(first, pa.schema([("text", pa.string())])) as writer:  # a row group at a time: little memory here
        for group in range(50):
            writer.write_table(pa.table({"text": [f"{group * 500 + i:09d} {base}" for i in range(500)]}))
    for index in range(1, shards):
        (directory / f"part-{index:03d}.parquet").hardlink_to(first)


@pytest.fixture(scope="module")
def uninterrupted(sources, tmp_path_factory):
    """The uninterrupted 4-step run of a source (saved every 2), once per module: the resume
    test's reference, and the memory test's runs."""
    root, _ = sources
    runs: dict[tuple[str, ...], tuple] = {}

    def run(source: str, *extra: str) -> tuple:
        if source == GIGABYTE and not (root / source).exists():
            gigabyte_of_parquet(root / source)
        if (source, *extra) not in runs:
            directory = tmp_path_factory.mktemp("full")
            runs[(source, *extra)] = (directory, train("--data", str(root / source), *extra, *FULL_RUN, "--save-dir", str(directory)))
        return runs[(source, *extra)]

    return run


@pytest.mark.parametrize(("source", "extra"), [("corpus.jsonl", []), (GIGABYTE, ["--data-streaming"])])
def test_an_interrupted_run_resumed_equals_the_uninterrupted_one_bitwise(uninterrupted, tmp_path, source, extra):
    directory, full = uninterrupted(source, *extra)
    step2 = directory / "step-00000002"
    resumed = train("--resume", str(step2), "--nproc-per-node", "2", "--save-dir", str(tmp_path / "resumed"))
    assert resumed["resumed_from_step"] == 2 and resumed["losses"] == full["losses"][2:]
    reference, mine = weights(directory), weights(tmp_path / "resumed")
    assert reference.keys() == mine.keys() and all(torch.equal(reference[n], mine[n]) for n in reference)
    inspect = runner.invoke(app, ["inspect", str(step2)])
    shown = "data        streamed, next: rank 0: epoch 0, shard 0 row" if extra else "data        packed, next: window 8 of"
    assert inspect.exit_code == 0 and shown in inspect.stdout, inspect.output


def test_a_resume_on_other_documents_is_exit_3_naming_the_data_position(uninterrupted, tmp_path):
    """A resumed run checks the checkpoint's data position against where its own data puts the
    step: other documents are refused, not trained on from another place in another stream."""
    directory, _ = uninterrupted("corpus.jsonl")
    write_jsonl(tmp_path / "other.jsonl", corpus(seed=9))
    args = ["train", "--resume", str(directory / "step-00000002"), "--data", str(tmp_path / "other.jsonl"), "--json"]
    result = runner.invoke(app, [*args, "--save-dir", str(tmp_path / "resumed")])
    assert result.exit_code == 3 and "the checkpoint's data position (epoch 0, window 8, " in result.output, result.output
    assert "the data changed since it was saved" in result.output


def test_a_run_streaming_a_gigabyte_peaks_within_200_mb_of_one_on_kilobytes_in_memory(sources, uninterrupted):
    """The workers' peak RSS (the summary's peak_memory_bytes on CPU: each worker's own VmHWM, the
    largest of the ranks) streaming 1 GB of text, against the same run on the jsonl test corpus of
    a few KB held in memory (a stricter baseline than 10 MB, with no dataset to speak of)."""
    root, texts = sources
    assert sum(len(t.encode()) for t in texts) < 100_000
    _, small = uninterrupted("corpus.jsonl")
    _, large = uninterrupted(GIGABYTE, "--data-streaming")
    shards = sorted((root / GIGABYTE).glob("*.parquet"))
    first = pq.ParquetFile(shards[0])
    characters = len(shards) * first.metadata.num_rows * len(first.read_row_group(0).column("text")[0].as_py())
    assert characters >= 1_000_000_000 and len(large["losses"]) == 4
    assert large["peak_memory_bytes"] < small["peak_memory_bytes"] + 200 * 2**20, (small["peak_memory_bytes"], large["peak_memory_bytes"])


def test_prepare_data_writes_the_packed_tokens_of_documents_whatever_the_process_count(sources, tmp_path):
    root, texts = sources
    files = {}
    for procs in ("1", "2"):
        out = tmp_path / f"tokens-{procs}.bin"
        result = runner.invoke(app, ["prepare-data", str(root / "shards"), str(out), "--num-proc", procs, "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["documents"] == len(texts)
        files[procs] = np.fromfile(out, dtype="<u2")
    assert np.array_equal(files["1"], packed_reference(texts)) and np.array_equal(files["2"], files["1"])


def test_eval_data_is_the_held_out_source_and_training_keeps_every_token(sources):
    root, texts = sources
    source = TokenSource(str(root / "corpus.jsonl"), vocab_size=256, seq_len=31, seed=0, eval_data=str(root / "shards/part-002.parquet"))
    assert np.array_equal(source.train_tokens, packed_reference(texts))
    assert np.array_equal(source.held_out_tokens, packed_reference(texts[40:]))
    assert source.order.count == len(packed_reference(texts)) // 32


def test_an_hf_tokenizer_packs_each_document_with_its_own_eos_token(sources, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from fsdpkit.data.tokens import load_tokenizer

    root, texts = sources
    (tmp_path / "corpus.txt").write_text("\n".join(texts))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(tmp_path / "corpus.txt")], trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(tmp_path / "tok")
    oracle = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    packed = pack_corpus(open_documents(str(root / "corpus.jsonl")), load_tokenizer(f"hf:{tmp_path / 'tok'}"), vocab_size=300)
    expected = [token for text in texts for token in [*oracle.encode(text, add_special_tokens=False), oracle.eos_token_id]]
    assert packed.tokens.tolist() == expected
