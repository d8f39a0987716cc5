"""The AWS common runtime's S3 client as a second request engine (``destination.engine =
"crt"``): the PutObject of a shard below the multipart threshold and the commit's HEAD of every
shard, the two requests each shard of a many-small-shards drain makes, built, signed and sent in
C rather than by botocore.

On the test machine botocore costs about 3 CPU ms per 1 MiB PutObject and 0.9 ms per HEAD,
the runtime about 1.1 ms and 0.13 ms (docs/benchmarks.md). Everything else (multipart uploads,
listings, part records, manifests, deletes, reads) stays on aiobotocore, which stays the
default engine. Answers and failures take botocore's shapes (a HEAD's answer dict, an
S3Failure built from the same ClientError classification), so what decides (s3.py, the
commit) does not know which engine sent a request.

Each request is one HTTP request (the runtime's DEFAULT meta request: it never splits a body
into a multipart upload of its own), signed with the credentials botocore's chain resolved, and
bounded like botocore's: ``max_attempts`` tries, each within the connect and read timeouts.
"""

from __future__ import annotations

import asyncio
import email.utils
import os
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

from botocore.exceptions import ClientError, NoCredentialsError

from ckptdrain.daemon.backends.s3errors import S3Failure
from ckptdrain.daemon.backends.s3parts import crc64_header

if TYPE_CHECKING:
    from ckptdrain.daemon.backends.s3client import S3Client
    from ckptdrain.daemon.config import DestinationConfig

# The runtime's I/O threads per process: they sign, checksum nothing (the checksum travels in a
# header we computed) and copy bytes between the file and the socket.
_IO_THREADS = 2
# Connections beyond max_concurrency bodies: the commit's HEADs, BATCH_AT_ONCE at a time.
_HEAD_CONNECTIONS = 16
_CODE = re.compile(rb"<Code>([^<]{1,128})</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]{0,512})</Message>")


class CrtEngine:
    """One process's runtime client, built on first use inside its event loop."""

    def __init__(self, owner: S3Client, config: DestinationConfig) -> None:
        self._owner = owner
        self._config = config
        endpoint = config.endpoint_url or f"https://s3.{config.region}.amazonaws.com"
        parts = urlsplit(endpoint)
        self._tls = parts.scheme == "https"
        virtual = config.addressing_style == "virtual" or (
            config.addressing_style == "auto" and config.endpoint_url is None)
        self._host = f"{config.bucket}.{parts.netloc}" if virtual else parts.netloc
        self._base = "/" if virtual else f"/{quote(config.bucket, safe='')}/"
        # botocore's bound: max_attempts tries, each within connect + read timeout.
        self._timeout_s = int(config.max_attempts) * (
            float(config.connect_timeout_s) + float(config.read_timeout_s))
        self._client: Any = None
        self._lock = asyncio.Lock()
        self._frozen: tuple[str, str, str | None] | None = None
        self._provider: Any = None

    def path(self, full_key: str) -> str:
        """The request path of an object key (S3's URI encoding: ``/`` kept)."""
        return self._base + quote(full_key, safe="/~")

    async def start(self) -> None:
        """Build the runtime's client (its threads, TLS context) now, not in the first drain."""
        await self._runtime()

    async def _runtime(self) -> Any:
        if self._client is not None:
            return self._client
        async with self._lock:
            if self._client is None:
                from awscrt import io, s3

                group = io.EventLoopGroup(_IO_THREADS)
                bootstrap = io.ClientBootstrap(group, io.DefaultHostResolver(group))
                await self._credentials()
                self._client = s3.S3Client(
                    bootstrap=bootstrap, region=self._config.region,
                    tls_mode=s3.S3RequestTlsMode.ENABLED if self._tls
                    else s3.S3RequestTlsMode.DISABLED,
                    credential_provider=self._provider,
                    max_active_connections_override=int(self._config.max_concurrency)
                    + _HEAD_CONNECTIONS,
                    retry_config=s3.S3RetryConfig(max_retries=int(self._config.max_attempts) - 1),
                    connect_timeout_ms=int(float(self._config.connect_timeout_s) * 1000),
                )
        return self._client

    async def _credentials(self) -> None:
        """The credentials botocore's chain resolves (environment, profile, instance role),
        frozen now: refreshed ones (a role's) are picked up before each request."""
        from awscrt.auth import AwsCredentialsProvider

        found = await self._owner._session.get_credentials()
        if found is None:
            raise NoCredentialsError()
        frozen = await found.get_frozen_credentials()
        key = (frozen.access_key, frozen.secret_key, frozen.token)
        if key != self._frozen:
            self._provider = AwsCredentialsProvider.new_static(*key)
            self._frozen = key

    async def put(self, what: str, full: str, fd: int, size: int, crc: int,
                  metadata: dict[str, str], exclusive: bool) -> None:
        """PutObject ``size`` bytes of ``fd`` (all of it) under ``full``, declaring its
        CRC64NVME ``crc`` (the server refuses a body that does not match it)."""
        headers = [("Host", self._host), ("Content-Length", str(size)),
                   ("Content-Type", "binary/octet-stream"),
                   ("x-amz-checksum-crc64nvme", crc64_header(crc))]
        headers += [(f"x-amz-meta-{name}", value) for name, value in metadata.items()]
        if exclusive:
            headers.append(("If-None-Match", "*"))
        await self._send(what, "PutObject", "PUT", full, headers, fd)

    async def head(self, what: str, full: str) -> dict[str, Any]:
        """HeadObject with its stored checksum, as botocore's answer (ContentLength,
        LastModified, ETag, Metadata, ChecksumCRC64NVME, ChecksumType)."""
        headers = await self._send(what, "HeadObject", "HEAD", full,
                                   [("Host", self._host), ("x-amz-checksum-mode", "ENABLED")])
        return head_answer(headers)

    async def _send(self, what: str, operation: str, method: str, full: str,
                    headers: list[tuple[str, str]], fd: int | None = None
                    ) -> list[tuple[str, str]]:
        from awscrt import http, s3
        from awscrt.exceptions import AwsCrtError

        try:
            client = await self._runtime()
            await self._credentials()
        except (AwsCrtError, NoCredentialsError) as exc:
            raise self._failure(what, operation, exc) from exc
        answered: list[list[tuple[str, str]]] = []

        def on_headers(status_code: int, headers: list[tuple[str, str]], **_: Any) -> None:
            answered.append(headers)

        # The runtime opens the body by path; a duplicate of the caller's fd stays open until
        # the runtime is done with the request (even after we gave up on it), so the path can
        # never name a file that reused the number.
        body = os.dup(fd) if fd is not None else None
        try:
            request = client.make_request(
                type=s3.S3RequestType.DEFAULT, operation_name=operation,
                request=http.HttpRequest(method, self.path(full), http.HttpHeaders(headers)),
                send_filepath=None if body is None else f"/proc/self/fd/{body}",
                credential_provider=self._provider, on_headers=on_headers)
        except BaseException:
            if body is not None:
                os.close(body)
            raise
        done = request.finished_future
        if body is not None:
            done.add_done_callback(lambda _: os.close(body))
        ended = asyncio.wrap_future(done)
        # A request given up on still ends later, often with an error nobody awaits: read it
        # here, or asyncio logs "exception was never retrieved" for each one.
        ended.add_done_callback(_retrieve)
        try:
            async with asyncio.timeout(self._timeout_s):
                # Shielded: cancelling our wait must not mark the runtime's future done (its
                # callback would close the body while the runtime may still read it).
                await asyncio.shield(ended)
        except TimeoutError as exc:
            request.cancel()
            raise self._failure(what, operation, exc) from exc
        except asyncio.CancelledError:
            request.cancel()
            raise
        except AwsCrtError as exc:
            raise self._failure(what, operation, exc) from exc
        return answered[-1] if answered else []

    def _failure(self, what: str, operation: str, exc: BaseException) -> S3Failure:
        """The S3Failure botocore's path would raise for the same answer."""
        status = getattr(exc, "status_code", None)
        if status:
            raw = getattr(exc, "body", None) or b""
            code = _CODE.search(raw)
            message = _MESSAGE.search(raw)
            exc = ClientError({
                "Error": {"Code": code.group(1).decode("ascii", "replace") if code
                          else str(status),
                          "Message": message.group(1).decode("utf-8", "replace") if message
                          else getattr(exc, "name", "")},
                "ResponseMetadata": {"HTTPStatusCode": int(status)}}, operation)
        elif not isinstance(exc, (TimeoutError, NoCredentialsError)):
            name = str(getattr(exc, "name", type(exc).__name__))
            detail = f"{name}: {getattr(exc, 'message', exc)}"
            # No answer came back: the network, as botocore's connection errors.
            exc = TimeoutError(detail) if "TIMEOUT" in name else ConnectionError(detail)
        return self._owner._failure(what, exc)

    async def aclose(self) -> None:
        # The runtime's client shuts its threads down when it is collected.
        self._client = None


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def head_answer(headers: list[tuple[str, str]]) -> dict[str, Any]:
    """A HEAD's response headers as botocore's head_object answer."""
    by_name = {name.lower(): value for name, value in headers}
    answer: dict[str, Any] = {
        "ContentLength": int(by_name.get("content-length") or 0),
        "ETag": by_name.get("etag", ""),
        "Metadata": {name[len("x-amz-meta-"):]: value for name, value in by_name.items()
                     if name.startswith("x-amz-meta-")},
    }
    if "last-modified" in by_name:
        answer["LastModified"] = email.utils.parsedate_to_datetime(by_name["last-modified"])
    if "x-amz-checksum-crc64nvme" in by_name:
        answer["ChecksumCRC64NVME"] = by_name["x-amz-checksum-crc64nvme"]
    if "x-amz-checksum-type" in by_name:
        answer["ChecksumType"] = by_name["x-amz-checksum-type"]
    return answer
