"""The storage face against a real S3 endpoint (moto's server) and a local directory: ranged
reads, multipart writes, the conditional create, retries through a fault-injecting proxy,
and the one-line errors for missing credentials, buckets and other clouds' URLs. boto3, a
client independent of fsdpkit's, is the oracle for what is on the server."""

from __future__ import annotations

import os

import pytest
from support.fault_proxy import FaultProxy
from support.object_store import s3_client

from fsdpkit.checkpoint.storage.face import PART_BYTES, READ_BLOCK_BYTES
from fsdpkit.checkpoint.storage.location import open_storage, parse_url
from fsdpkit.errors import DataCheckError, RunError, UsageError


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path):
    if request.param == "local":
        return open_storage(tmp_path / "store")
    bucket = request.getfixturevalue("s3_bucket")
    return open_storage(f"s3://{bucket}/run/one")


def test_ranged_reads_multipart_write_list_delete(storage):
    data = os.urandom(2 * PART_BYTES + 12345)  # three parts on an object store
    buffer = bytearray(3 << 20)  # refilled before each write, as a reader's block is
    with storage.write("step/rank-0.bin") as stream:
        for first in range(0, len(data), len(buffer)):
            piece = data[first : first + len(buffer)]
            buffer[: len(piece)] = piece
            stream.write(memoryview(buffer)[: len(piece)])
    storage.put("step/small", b"abc")
    assert storage.list() == {"step/rank-0.bin": len(data), "step/small": 3}
    assert storage.list("step") == storage.list() and storage.list("ste") == {}
    assert storage.size("step/rank-0.bin") == len(data) and storage.size("nothing") is None
    assert storage.read("step/rank-0.bin") == data and storage.read("step/rank-0.bin", 5, 105) == data[5:105]
    ranges = [(7, 20), (1000, 1000 + 3 * READ_BLOCK_BYTES // 2), (len(data) - 10, len(data))]
    blocks = [(offset, bytes(block)) for offset, block in storage.read_blocks("step/rank-0.bin", ranges)]
    assert [offset for offset, _ in blocks] == sorted(offset for offset, _ in blocks)
    assert b"".join(block for _, block in blocks) == b"".join(data[start:end] for start, end in ranges)
    assert all(len(block) <= READ_BLOCK_BYTES for _, block in blocks)
    storage.delete(["step/small", "step/never-written"])
    assert list(storage.list()) == ["step/rank-0.bin"]
    with pytest.raises(DataCheckError, match="missing"):
        storage.read("step/small")
    with pytest.raises(DataCheckError, match=f"ends at byte {len(data)}, 10 bytes early"):  # on disk and in a bucket alike
        list(storage.read_blocks("step/rank-0.bin", [(len(data) - 100, len(data) + 10)]))


def test_a_failed_write_leaves_nothing(storage):
    with pytest.raises(KeyError), storage.write("big") as stream:
        stream.write(os.urandom(PART_BYTES + 1))  # one part uploaded on an object store
        raise KeyError("interrupted")
    assert storage.list() == {}


def test_publish_commits_last_and_a_failed_one_over_a_checkpoint_leaves_no_commit_object(tmp_path):
    """`publish` of a directory: the commit object is the last object completed. Objects without
    the marker, or the marker beside a whole checkpoint, are no interrupted write (--overwrite is
    needed). Published again over it (--overwrite), the old objects the new checkpoint does not
    replace are gone. Published again and failing midway: neither the old nor the new manifest
    is left, nor any object it wrote, only the marker, so no reader takes the mix of old and new
    objects for a checkpoint and the rerun needs no --overwrite."""
    import contextlib

    from fsdpkit.checkpoint.storage.local import LocalStorage
    from fsdpkit.checkpoint.storage.upload import WRITING_MARKER, check_destination, claim_destination, publish

    completed: list[str] = []

    class Recorded(LocalStorage):
        failing = ""

        @contextlib.contextmanager
        def write(self, name):
            with super().write(name) as stream:
                if name == self.failing:
                    raise RunError(f"{name}: write failed")
                yield stream
            completed.append(name)

        def create_exclusive(self, name, data):
            made = super().create_exclusive(name, data)
            completed.extend([name] if made else [])
            return made

    def published(source, *, overwrite: bool) -> None:
        lease, existing = claim_destination(destination, overwrite=overwrite)
        publish(source, destination, existing, lease)

    names = ["manifest.json", "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    for step in (1, 2):
        for name in names:
            (tmp_path / f"src{step}" / name).parent.mkdir(exist_ok=True)
            (tmp_path / f"src{step}" / name).write_bytes(f"{name} of step {step}".encode())
    destination = Recorded(tmp_path / "dst")
    destination.put("notes.txt", b"not a checkpoint")  # objects with no marker beside them
    for refused in (check_destination, claim_destination):
        with pytest.raises(UsageError, match="already holds 1 object; pass --overwrite"):
            refused(destination, overwrite=False)
    assert destination.list() == {"notes.txt": 16}  # the refused claim gave its lease up, as it found the destination
    destination.delete(["notes.txt"])
    completed.clear()
    published(tmp_path / "src1", overwrite=False)
    assert completed[0] == WRITING_MARKER and sorted(completed[1:]) == names and completed[-1] == "manifest.json", completed
    assert destination.read("manifest.json") == b"manifest.json of step 1" and WRITING_MARKER not in destination.list()
    destination.put(WRITING_MARKER, b"")  # as a publish killed after its commit object leaves it
    with pytest.raises(UsageError, match="already holds 4 objects; pass --overwrite"):
        check_destination(destination, overwrite=False)  # a whole checkpoint beside the marker
    destination.delete([WRITING_MARKER])
    (tmp_path / "src2" / names[-1]).rename(tmp_path / "rank-1")  # a checkpoint of one rank file replaces one of two
    published(tmp_path / "src2", overwrite=True)
    left = {name: destination.read(name) for name in destination.list()}
    assert left == {name: (tmp_path / "src2" / name).read_bytes() for name in names[:-1]}, left  # the old rank 1 file gone
    (tmp_path / "rank-1").rename(tmp_path / "src2" / names[-1])
    destination.failing = names[-1]
    with pytest.raises(RunError, match="write failed"):
        published(tmp_path / "src2", overwrite=True)
    left = {name: destination.read(name) for name in destination.list()}
    assert left == {WRITING_MARKER: b""}, left  # every name it writes removed, the one it did upload too
    check_destination(destination, overwrite=False)  # an interrupted write: no --overwrite needed


def test_a_lease_given_up_on_a_failure_reports_that_failure_not_its_own(tmp_path):
    """A block under the writer's lease that fails where the store fails too: the block's error
    is the one raised (the marker could not be emptied); on a working store the marker is left
    empty, what the next writer takes at once."""
    from fsdpkit.checkpoint.storage.lease import WRITING_MARKER, WriterLease
    from fsdpkit.checkpoint.storage.local import LocalStorage

    class Failing(LocalStorage):
        def put(self, name, data):
            raise RunError(f"{name}: the store is gone")

    for storage in (Failing(tmp_path / "gone"), LocalStorage(tmp_path / "up")):
        with pytest.raises(ValueError, match="the conversion failed"), WriterLease.take(storage, beat_seconds=60):
            raise ValueError("the conversion failed")
    assert f'"pid": {os.getpid()}'.encode() in Failing(tmp_path / "gone").read(WRITING_MARKER)  # as taken: its holder's exit frees it
    assert LocalStorage(tmp_path / "up").read(WRITING_MARKER) == b""
    WriterLease.take(LocalStorage(tmp_path / "up")).release(interrupted=False)
    assert LocalStorage(tmp_path / "up").list() == {}


def test_a_holder_in_another_process_id_namespace_of_this_host_is_not_judged_by_a_pid_here(tmp_path):
    """Containers on one host may share its name, not its processes: a holder recorded in another
    process-id namespace is not judged by a pid of this one. The run lock keeps refusing it, as
    another host's, although no process here has its pid; the writer's lease watches its marker
    and takes it over once it stops changing, although its pid (this process's) runs here."""
    import json
    import subprocess
    import sys

    from fsdpkit.checkpoint.format.lock import LOCK_NAME, RunLock
    from fsdpkit.checkpoint.storage.lease import WRITING_MARKER, WriterLease
    from fsdpkit.checkpoint.storage.local import LocalStorage
    from fsdpkit.holder import process_identity

    beside = {**process_identity(), "pid_ns": "pid:[1]"}
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_NAME).write_text(json.dumps({**beside, "pid": int(gone.stdout), "run": "theirs"}))
    with pytest.raises(UsageError, match=f"is in use by another run: pid {int(gone.stdout)} on "):
        RunLock.acquire(tmp_path / "run")
    storage = LocalStorage(tmp_path / "out")
    storage.put(WRITING_MARKER, json.dumps({**beside, "lease": "theirs", "beat_seconds": 0.05, "beat": 0}).encode())
    WriterLease.take(storage).release(interrupted=False)
    assert storage.list() == {}


def test_a_lease_taken_over_while_its_holder_stalled_commits_nothing_and_leaves_the_new_marker(tmp_path):
    """A holder whose beats stopped long enough for another command to take its lease over, and
    that then goes on: its beats no longer rewrite the marker, its publish writes no commit
    object (a RunError), and giving the lease up leaves the new holder's marker as it is."""
    import json
    import time

    from fsdpkit.checkpoint.storage.lease import WRITING_MARKER, WriterLease
    from fsdpkit.checkpoint.storage.local import LocalStorage
    from fsdpkit.checkpoint.storage.upload import publish

    storage = LocalStorage(tmp_path / "dst")
    for name, data in (("rank-00000-of-00001.safetensors", b"data"), ("manifest.json", b"{}")):
        (tmp_path / "new" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "new" / name).write_bytes(data)
    theirs = json.dumps({"host": "another-node", "pid": 1, "lease": "theirs", "beat_seconds": 0.05, "beat": 0}).encode()
    beating = WriterLease.take(storage, beat_seconds=0.02)
    storage.put(WRITING_MARKER, theirs)  # as the command that took it over made it
    for _ in range(1000):  # its next beat finds the marker another's and stops: 10 s at most
        if not beating._beats.is_alive():
            break
        time.sleep(0.01)
    assert not beating._beats.is_alive() and storage.read(WRITING_MARKER) == theirs
    beating.release(interrupted=False)
    assert storage.read(WRITING_MARKER) == theirs
    stalled = WriterLease.take(storage, beat_seconds=60)  # theirs, on another host, stopped changing: taken over
    storage.put(WRITING_MARKER, theirs)
    with pytest.raises(RunError, match="another fsdpkit command took the destination over while this one was stalled"):
        publish(tmp_path / "new", storage, {}, stalled)
    assert storage.list() == {WRITING_MARKER: len(theirs)} and storage.read(WRITING_MARKER) == theirs


def test_conditional_create_makes_one_writer(storage):
    assert storage.create_exclusive("lock", b"first")
    assert not storage.create_exclusive("lock", b"second")
    assert storage.read("lock") == b"first"


def test_an_aborted_multipart_upload_is_gone_from_the_server(s3_bucket, s3_endpoint):
    storage = open_storage(f"s3://{s3_bucket}/p")
    with pytest.raises(KeyError), storage.write("big") as stream:
        stream.write(os.urandom(2 * PART_BYTES))
        raise KeyError("interrupted")
    client = s3_client(s3_endpoint)
    assert client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert client.list_objects_v2(Bucket=s3_bucket).get("KeyCount") == 0


def test_faults_are_retried(s3_bucket, s3_endpoint, monkeypatch):
    data = os.urandom(3 * PART_BYTES + 99)
    with FaultProxy(s3_endpoint, fraction=0.3, seed=3) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        storage = open_storage(f"s3://{s3_bucket}/p")
        with storage.write("obj") as stream:
            stream.write(data)
        storage.commit("manifest.json", b"{}")
        got = b"".join(bytes(block) for _, block in storage.read_blocks("obj", [(0, len(data))], block_bytes=1 << 20))
        listed = storage.list()
    assert all(proxy.faults.values()), proxy.faults  # each kind of fault was met and survived
    assert got == data and listed == {"obj": len(data), "manifest.json": 2}
    body = s3_client(s3_endpoint).get_object(Bucket=s3_bucket, Key="p/obj")["Body"].read()
    assert body == data


def test_a_read_cut_off_midway_resumes_where_it_stopped(s3_bucket, s3_endpoint, monkeypatch):
    """GETs whose answers end after half their bytes: each stream resumes from the byte where it
    was cut, so every byte comes once and in order, in one segment and across several."""
    import fsdpkit.checkpoint.storage.objects as objects

    data = os.urandom(3 * (1 << 20) + 333)
    open_storage(f"s3://{s3_bucket}/p").put("obj", data)
    for segment_bytes in (objects.SEGMENT_BYTES, 1 << 20):
        monkeypatch.setattr(objects, "SEGMENT_BYTES", segment_bytes)
        with FaultProxy(s3_endpoint, fraction=0.5, seed=7, kinds=("cut",), methods=("GET",)) as proxy:
            monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
            blocks = list(open_storage(f"s3://{s3_bucket}/p").read_blocks("obj", [(5, len(data))], block_bytes=300_000))
        assert proxy.faults["cut"] > 0
        assert [offset for offset, _ in blocks] == sorted(offset for offset, _ in blocks)
        assert b"".join(bytes(block) for _, block in blocks) == data[5:]


def test_a_write_that_keeps_failing_names_the_object_and_commits_nothing(s3_bucket, s3_endpoint, monkeypatch):
    import fsdpkit.checkpoint.storage.objects as objects

    monkeypatch.setattr(objects, "RETRIES", 1)
    with FaultProxy(s3_endpoint, fraction=1.0, kinds=("503",)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        storage = open_storage(f"s3://{s3_bucket}/p")
        with pytest.raises(
            RunError,
            match=rf"s3://{s3_bucket}/p/manifest.json: write failed after retries, nothing committed: HTTP 503 .*SlowDown",
        ):
            storage.commit("manifest.json", b"{}")
    assert s3_client(s3_endpoint).list_objects_v2(Bucket=s3_bucket).get("KeyCount") == 0


def test_a_missing_bucket_is_one_line(s3_bucket):
    with pytest.raises(UsageError, match="s3://no-such-bucket-here: the bucket does not exist"):
        open_storage("s3://no-such-bucket-here").list()


def test_credentials_come_from_a_profile(s3_bucket, tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(UsageError, match="no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"):
        open_storage(f"s3://{s3_bucket}/p")
    credentials = tmp_path / "credentials"
    credentials.write_text("[train]\naws_access_key_id = testing\naws_secret_access_key = s3cr3t-value\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_PROFILE", "other")
    with pytest.raises(UsageError, match="AWS_PROFILE=other: no such profile"):
        open_storage(f"s3://{s3_bucket}/p")
    monkeypatch.setenv("AWS_PROFILE", "train")
    storage = open_storage(f"s3://{s3_bucket}/p")
    storage.put("x", b"1")
    assert storage.list() == {"x": 1}


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("gs://bucket/run", "gs://bucket/run: no Google Cloud credentials found: set GOOGLE_APPLICATION_CREDENTIALS"),
        ("az://container/run", "az://container/run: no Azure storage account: set AZURE_STORAGE_ACCOUNT_NAME"),
        ("ftp://host/run", "unknown storage scheme 'ftp'"),
        ("s3:///run", "no bucket named"),
        ("s3://Bad_Bucket/run", "not a valid bucket name"),
        ("s3://bucket/a/../b", "has an empty, '.' or '..' part"),
    ],
)
def test_urls_fsdpkit_cannot_use_are_one_line(url, message, monkeypatch, tmp_path):
    for name in [name for name in os.environ if name.startswith(("GOOGLE_", "AZURE_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(UsageError, match=message):
        open_storage(url)


def test_azure_with_an_account_needs_a_secret(monkeypatch, tmp_path):
    for name in [name for name in os.environ if name.startswith("AZURE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    with pytest.raises(UsageError, match="no Azure credentials found: set AZURE_STORAGE_ACCOUNT_KEY"):
        open_storage("az://container/run")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "a2V5")
    assert parse_url("az://container/run/x").prefix == parse_url("az://container/run/x/").prefix == "run/x"  # a directory's slash
    assert open_storage("az://container/run").where("a/b") == "az://container/run/a/b"


def test_no_secret_in_any_message(s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDWRONG")
    with pytest.raises(UsageError) as raised:
        open_storage("s3://no-such-bucket-here/p").list()
    assert "s3cr3t" not in str(raised.value) and "\n" not in str(raised.value)


def test_an_object_of_many_segments_streams_in_order(s3_bucket, monkeypatch):
    """Segments (one streamed GET each, two in flight) and blocks cut at odd sizes come back
    in offset order, every byte once; a reader that stops early leaves no stream behind."""
    import threading

    import fsdpkit.checkpoint.storage.objects as objects

    monkeypatch.setattr(objects, "SEGMENT_BYTES", 1 << 20)
    data = os.urandom(5 * (1 << 20) + 777)
    storage = open_storage(f"s3://{s3_bucket}/p")
    storage.put("obj", data)
    ranges = [(3, 2 * (1 << 20) + 5), (2 * (1 << 20) + 9, len(data))]
    blocks = list(storage.read_blocks("obj", ranges, block_bytes=300_000))
    assert [offset for offset, _ in blocks] == sorted(offset for offset, _ in blocks)
    assert b"".join(bytes(block) for _, block in blocks) == b"".join(data[start:end] for start, end in ranges)
    stream = storage.read_blocks("obj", [(0, len(data))], block_bytes=100_000)
    assert bytes(next(stream)[1]) == data[:100_000]
    stream.close()
    assert not [thread.name for thread in threading.enumerate() if thread.name.startswith("fsdpkit-get")]


def test_a_long_write_waits_for_its_parts_and_stays_whole(s3_bucket, s3_endpoint, monkeypatch):
    """The writer waits for the parts in flight every PARTS_IN_FLIGHT parts (bounded memory);
    boto3 reads back every byte."""
    import fsdpkit.checkpoint.storage.objects as objects

    monkeypatch.setattr(objects, "PARTS_IN_FLIGHT", 1)
    data = os.urandom(3 * PART_BYTES + 5)
    with open_storage(f"s3://{s3_bucket}/p").write("obj") as stream:
        for first in range(0, len(data), 1 << 20):
            stream.write(data[first : first + (1 << 20)])
    assert s3_client(s3_endpoint).get_object(Bucket=s3_bucket, Key="p/obj")["Body"].read() == data


def test_runs_read_in_file_order_share_their_gets_and_runs_apart_fetch_only_themselves(s3_bucket, s3_endpoint, monkeypatch):
    """The byte engine's runs of one object (a ZeRO-3 rank file's partitions, tensor by tensor):
    runs that each start where the last ended continue one longer GET instead of a GET each,
    and runs with gaps between them fetch their own bytes and no more; a `pread` larger than the
    kept blocks is one GET of its own bytes, not the blocks around them; boto3 wrote the bytes."""
    from fsdpkit.checkpoint.storage.handle import open_handle

    data, run = os.urandom(6 << 20), 64 << 10
    s3_client(s3_endpoint).put_object(Bucket=s3_bucket, Key="runs/rank-0.pt", Body=data)
    for stride in (run, 2 * run):  # back to back, then with a gap after each run
        with FaultProxy(s3_endpoint, fraction=0.0) as proxy:
            monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
            handle, _ = open_handle(open_storage(f"s3://{s3_bucket}/runs"), "rank-0.pt")
            asked = proxy.requests
            got = [handle.window(offset, run, offset + run) for offset in range(0, len(data), stride)]
            handle.close()
            gets = proxy.requests - asked
        assert got == [data[offset : offset + run] for offset in range(0, len(data), stride)]
        if stride == run:
            assert gets <= 2, gets  # 96 runs: the first GET, then one to the object's end
        else:
            assert gets == len(got) and proxy.got_bytes == len(got) * run, (gets, proxy.got_bytes)
    with FaultProxy(s3_endpoint, fraction=0.0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        handle, _ = open_handle(open_storage(f"s3://{s3_bucket}/runs"), "rank-0.pt")
        asked = proxy.requests
        assert handle.pread(1 << 20, 12345) == data[12345 : 12345 + (1 << 20)]
        assert (proxy.requests - asked, proxy.got_bytes) == (1, 1 << 20)
