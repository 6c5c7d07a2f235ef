"""The multipart uploads a killed writer left open, aborted by the next writer: the SigV4
signature of the requests obstore has no call for equals botocore's (the independent signer);
a reshard run again into a prefix that holds the marker of a write cut short aborts the
uploads open under that prefix, and only there (boto3 lists them); an upload initiated after
the writer began is never aborted. The train side (a save after a killed one) is in
tests/train/test_train_object_storage.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from unittest import mock

import pytest
from support.checkpoint_files import run_cli, sample_optimizer, sample_tensors, save_checkpoint
from support.object_store import s3_client

from fsdpkit.checkpoint.storage.credentials import S3Access
from fsdpkit.checkpoint.storage.location import open_storage
from fsdpkit.checkpoint.storage.sigv4 import S3Requests
from fsdpkit.checkpoint.storage.stale_uploads import OpenUpload, abort_stale_uploads, stale_uploads

REQUESTS = [
    ("GET", "", {"uploads": "", "prefix": "runs/a b+c/"}),
    ("GET", "", {"uploads": "", "prefix": "runs/", "key-marker": "runs/x", "upload-id-marker": "id/+="}),
    ("DELETE", "runs/k/step-00000004/rank 0+x~.safetensors", {"uploadId": "abc/+=="}),
]


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9000", "https://minio.example:9443/base", None])
@pytest.mark.parametrize("token", [None, "session/token+="])
def test_the_signature_equals_botocores(endpoint, token):
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    now = datetime(2026, 12, 7, 2, 0, 0, tzinfo=UTC)
    requests = S3Requests(S3Access("AKIDEXAMPLE", "wJalr/XUtnFEMI+K7MDENG", token, "eu-west-1", endpoint), "my-bucket")
    for method, key, query in REQUESTS:
        path = requests.path(key)
        mine = requests.signed_headers(method, path, query, now)
        theirs = AWSRequest(  # botocore encodes the query's parameters itself
            method=method,
            url=f"{requests.scheme}://{requests.host}{path}",
            params=query,
            headers={"x-amz-content-sha256": mine["x-amz-content-sha256"]},
        )
        with mock.patch("botocore.auth.get_current_datetime", return_value=now.replace(tzinfo=None)):
            S3SigV4Auth(Credentials("AKIDEXAMPLE", "wJalr/XUtnFEMI+K7MDENG", token), "s3", "eu-west-1").add_auth(theirs)
        assert mine["authorization"] == theirs.headers["Authorization"], (method, key, query)
        assert "wJalr" not in repr(requests._access)


def test_a_rerun_into_a_prefix_a_killed_write_left_aborts_the_uploads_open_there_only(s3_bucket, s3_endpoint, tmp_path):
    params = sample_tensors()
    save_checkpoint(tmp_path / "run", 1, {**params, **sample_optimizer(params)}, world_size=2)
    client = s3_client(s3_endpoint)
    client.put_object(Bucket=s3_bucket, Key="out/.fsdpkit-writing", Body=b"")  # what a killed reshard leaves
    left = client.create_multipart_upload(Bucket=s3_bucket, Key="out/rank-00001-of-00003.safetensors")["UploadId"]
    client.upload_part(Bucket=s3_bucket, Key="out/rank-00001-of-00003.safetensors", UploadId=left, PartNumber=1, Body=b"x" * 1024)
    elsewhere = client.create_multipart_upload(Bucket=s3_bucket, Key="outside/model.safetensors")["UploadId"]
    assert run_cli("reshard", str(tmp_path / "run"), f"s3://{s3_bucket}/out", "--world-size", "3").exit_code == 0
    assert client.list_multipart_uploads(Bucket=s3_bucket, Prefix="out/").get("Uploads", []) == []
    assert [upload["UploadId"] for upload in client.list_multipart_uploads(Bucket=s3_bucket)["Uploads"]] == [elsewhere]


def test_an_upload_initiated_after_the_writer_began_stays_open(s3_bucket, s3_endpoint):
    client = s3_client(s3_endpoint)
    upload = client.create_multipart_upload(Bucket=s3_bucket, Key="run/step-00000002/rank-00000-of-00002.safetensors")["UploadId"]
    initiated = client.list_multipart_uploads(Bucket=s3_bucket)["Uploads"][0]["Initiated"]  # the server's time (moto: fixed)
    storage = open_storage(f"s3://{s3_bucket}/run")
    assert abort_stale_uploads(storage, initiated_before=initiated) == []  # within the clock margin
    assert [u["UploadId"] for u in client.list_multipart_uploads(Bucket=s3_bucket)["Uploads"]] == [upload]
    later = initiated + timedelta(seconds=2)
    assert abort_stale_uploads(storage, initiated_before=later) == ["step-00000002/rank-00000-of-00002.safetensors"]
    assert client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_stale_means_a_whole_second_before_the_writer_began():
    began = datetime(2026, 12, 7, 2, 0, 10, tzinfo=UTC)
    uploads = [OpenUpload(f"k{i}", str(i), began - timedelta(milliseconds=ms)) for i, ms in enumerate((0, 999, 1000, 1001, 60_000))]
    assert [upload.key for upload in stale_uploads(uploads, began)] == ["k3", "k4"]


def test_a_local_directory_is_left_alone(tmp_path):
    with mock.patch("fsdpkit.checkpoint.storage.stale_uploads.S3Requests") as requests:
        assert abort_stale_uploads(open_storage(str(tmp_path)), initiated_before=datetime.now(UTC)) == []
        requests.assert_not_called()
