"""The multipart uploads a killed writer left open, aborted by the next writer: the SigV4
signature of the requests obstore has no call for equals botocore's (the independent signer);
a reshard run again into a prefix that holds the marker of a write cut short aborts the
uploads open under that prefix, and only there (boto3 lists them), page by page; an upload
initiated after the writer began is never aborted. The train side (a save after a killed one) is in
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


def test_the_open_uploads_are_listed_page_by_page(s3_bucket, s3_endpoint):
    """The server's listing cut into pages of one upload each, as S3 pages it (moto answers in
    one page): every upload boto3 lists under the prefix is found, once."""
    import xml.etree.ElementTree as ElementTree
    from types import SimpleNamespace

    from fsdpkit.checkpoint.storage.credentials import s3_access
    from fsdpkit.checkpoint.storage.location import parse_url
    from fsdpkit.checkpoint.storage.stale_uploads import open_uploads

    client = s3_client(s3_endpoint)
    for key in ("run/a", "run/b", "run/b", "run/c/d"):
        client.create_multipart_upload(Bucket=s3_bucket, Key=key)
    listed = {(u["Key"], u["UploadId"]) for u in client.list_multipart_uploads(Bucket=s3_bucket, Prefix="run/")["Uploads"]}
    namespace = "{http://s3.amazonaws.com/doc/2006-03-01/}"

    def marker(upload: ElementTree.Element) -> tuple[str | None, str | None]:
        return upload.findtext(f"{namespace}Key"), upload.findtext(f"{namespace}UploadId")

    class OnePerPage(S3Requests):
        def request(self, method, key, query, *, what):
            answer = super().request(method, key, {"uploads": "", "prefix": query["prefix"]}, what=what)
            document = ElementTree.fromstring(answer.body)
            uploads = sorted(document.iter(f"{namespace}Upload"), key=marker)
            after = (query.get("key-marker", ""), query.get("upload-id-marker", ""))
            rest = [upload for upload in uploads if marker(upload) > after]
            for upload in uploads:
                document.remove(upload)
            document.extend(rest[:1])
            page = {"IsTruncated": "true" if len(rest) > 1 else "false"}
            if rest:
                page["NextKeyMarker"], page["NextUploadIdMarker"] = marker(rest[0])
            for name, text in page.items():
                found = document.find(f"{namespace}{name}")
                (ElementTree.SubElement(document, f"{namespace}{name}") if found is None else found).text = text
            return SimpleNamespace(status=answer.status, body=ElementTree.tostring(document))

    requests = OnePerPage(s3_access(parse_url(f"s3://{s3_bucket}/run")), s3_bucket)
    found = open_uploads(requests, "run/", where=f"s3://{s3_bucket}/run")
    assert len(found) == len(listed) == 4 and {(u.key, u.upload_id) for u in found} == listed
