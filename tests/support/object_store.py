"""A real S3 endpoint for tests: moto's server mode on a free port of 127.0.0.1, in this
process. `s3_environment` is the environment the AWS clients (obstore, boto3, s3fs) read."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterator

ACCESS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """The endpoint URL of a moto S3 server running for the block."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_environment(endpoint: str) -> dict[str, str]:
    return {**ACCESS, "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true"}


def s3_client(endpoint: str):
    """boto3's client of the test server: the independent side of the tests (buckets, listings,
    multipart uploads left open)."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing")
