"""S3 requests that obstore has no call for (listing and aborting other processes' multipart
uploads: `stale_uploads.py`), signed here with AWS Signature Version 4 (pure stdlib: hmac,
hashlib, http.client). Bodiless requests only; the keys, region and endpoint are the ones the
face's obstore store uses (`credentials.s3_access`); no key or signature is ever in a message.
AWS itself is addressed virtual-hosted style (`BUCKET.s3.REGION.amazonaws.com`), an
S3-compatible endpoint (`AWS_ENDPOINT_URL`) path-style (`ENDPOINT/BUCKET/KEY`). Throttling,
other 5xx answers and dropped connections are retried with exponential backoff and jitter."""

from __future__ import annotations

import hashlib
import hmac
import http.client
import random
import time
from datetime import UTC, datetime
from typing import NamedTuple
from urllib.parse import quote, urlsplit

from ...errors import RunError
from .credentials import S3Access

ALGORITHM = "AWS4-HMAC-SHA256"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
ATTEMPTS = 6
FIRST_BACKOFF_SECONDS = 0.1
TIMEOUT_SECONDS = 60


class Answer(NamedTuple):
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes


def _quoted(text: str) -> str:
    return quote(text, safe="-_.~")


class S3Requests:
    """Signed bodiless requests to one bucket."""

    def __init__(self, access: S3Access, bucket: str):
        self._access, self.bucket = access, bucket
        if access.endpoint:
            endpoint = urlsplit(access.endpoint)
            self.scheme, self.host = endpoint.scheme, endpoint.netloc
            self._base = f"{endpoint.path.rstrip('/')}/{_quoted(bucket)}"
        else:
            self.scheme, self.host, self._base = "https", f"{bucket}.s3.{access.region}.amazonaws.com", ""

    def path(self, key: str) -> str:
        """The request path of object `key` ("" for the bucket), each segment URI-encoded."""
        return f"{self._base}/{'/'.join(_quoted(part) for part in key.split('/'))}" if key else f"{self._base}/"

    def signed_headers(self, method: str, path: str, query: dict[str, str], now: datetime) -> dict[str, str]:
        """The headers that sign `method path?query` at time `now`."""
        stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        headers = {"host": self.host, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": stamp}
        if self._access.session_token:
            headers["x-amz-security-token"] = self._access.session_token
        names = sorted(headers)
        canonical = "\n".join(
            [
                method,
                path,
                canonical_query(query),
                *(f"{name}:{headers[name].strip()}" for name in names),
                "",
                ";".join(names),
                EMPTY_SHA256,
            ]
        )
        scope = f"{day}/{self._access.region}/s3/aws4_request"
        to_sign = f"{ALGORITHM}\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        key = f"AWS4{self._access.secret_access_key}".encode()
        for part in (day, self._access.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = (
            f"{ALGORITHM} Credential={self._access.access_key_id}/{scope}, SignedHeaders={';'.join(names)}, Signature={signature}"
        )
        return headers

    def request(self, method: str, key: str, query: dict[str, str], *, what: str) -> Answer:
        """`method` on object `key` (a bucket-level request for ""), retried; `what` names it in
        the one-line RunError raised when it still fails."""
        path = self.path(key)
        target = f"{path}?{canonical_query(query)}" if query else path
        reason = ""
        for attempt in range(ATTEMPTS):
            if attempt:
                time.sleep(FIRST_BACKOFF_SECONDS * 2 ** (attempt - 1) * (0.5 + random.random()))
            connection_type = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
            connection = connection_type(self.host, timeout=TIMEOUT_SECONDS)
            try:
                connection.request(method, target, headers=self.signed_headers(method, path, query, datetime.now(UTC)))
                response = connection.getresponse()
                answer = Answer(response.status, {name.lower(): value for name, value in response.getheaders()}, response.read())
            except (OSError, http.client.HTTPException) as error:
                reason = f"connection failed ({type(error).__name__})"
                continue
            finally:
                connection.close()
            if answer.status < 500 and answer.status != 429:
                return answer
            reason = f"HTTP {answer.status}"
        raise RunError(f"{what}: failed after {ATTEMPTS} attempts: {reason}")


def canonical_query(query: dict[str, str]) -> str:
    return "&".join(f"{_quoted(name)}={_quoted(value)}" for name, value in sorted(query.items()))
