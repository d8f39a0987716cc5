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

Each attempt is one HTTP request (the runtime's DEFAULT meta request: it never splits a body
into a multipart upload of its own) to the endpoint botocore resolved, signed with the
credentials botocore's chain resolved. The runtime does not retry (it has no read timeout to
retry on): :meth:`CrtEngine._send` makes up to ``max_attempts`` attempts, each given up after
its connect and read timeouts (plus its body's time at 1 MiB/s), and waits for a given-up
attempt to end before the next, so no two of a request's bodies are in flight at once.
It trusts botocore's CA bundle (``AWS_CA_BUNDLE``, ``ca_bundle``) where one is set. Where a proxy
applies to the endpoint (the runtime's S3 client takes none), the engine stands aside and
botocore sends these requests too.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import os
import random
import re
import urllib.request
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

from botocore.exceptions import ClientError

from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.backends.s3errors import S3Failure, no_s3_answer
from ckptdrain.daemon.backends.s3parts import crc64_header
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.threads import outlast

if TYPE_CHECKING:
    from ckptdrain.daemon.backends.s3client import S3Client
    from ckptdrain.daemon.config import DestinationConfig

log = logging.getLogger(__name__)

# The runtime's I/O threads per process: they sign, move bytes between the file and the
# socket and parse answers (the checksum travels in a header we computed).
_IO_THREADS = 2
# Connections beyond max_concurrency bodies: the commit's HEADs, BATCH_AT_ONCE at a time.
_HEAD_CONNECTIONS = 16
# An attempt's body may take this long at this rate on top of its timeouts (a 64 MiB PUT is
# given 64 s more): the runtime has no per-read timeout to tell slow from stuck.
_SLOWEST_BYTES_PER_S = 1 << 20
# How long a given-up attempt may take to end (the runtime holds its body and connection).
_END_GRACE_S = 10.0
# Retried here, as botocore's standard mode does: throttling, timeouts, the network, 5xx.
_RETRIED_KINDS = frozenset({"throttled", "timeout", "io"})
_MAX_BACKOFF_S = 20.0
# The runtime's names for answers it classifies itself: (S3 error code, HTTP status).
_ANSWERS = {
    "AWS_ERROR_S3_SLOW_DOWN": ("SlowDown", 503),
    "AWS_ERROR_S3_INTERNAL_ERROR": ("InternalError", 500),
    "AWS_ERROR_S3_REQUEST_TIMEOUT": ("RequestTimeout", 400),
    "AWS_ERROR_S3_REQUEST_TIME_TOO_SKEWED": ("RequestTimeTooSkewed", 403),
}
_CODE = re.compile(rb"<Code>([^<]{1,128})</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]{0,512})</Message>")


class CrtEngine:
    """One process's runtime client, built on first use inside its event loop."""

    def __init__(self, owner: S3Client, config: DestinationConfig) -> None:
        self._owner = owner
        self._config = config
        self._attempts = int(config.max_attempts)
        self._timeout_s = float(config.connect_timeout_s) + float(config.read_timeout_s)
        self._client: Any = None
        self._host = ""
        self._base = ""
        # Why the runtime cannot send this process's requests (None: it can, or not known yet).
        self.unusable: str | None = None
        self._lock = asyncio.Lock()
        self._frozen: tuple[str, str, str | None] | None = None
        self._provider: Any = None

    def path(self, full_key: str) -> str:
        """The request path of an object key (S3's URI encoding: ``/`` and ``~`` kept)."""
        return self._base + quote(full_key, safe="/~")

    async def start(self) -> None:
        """Build the runtime's client (its threads, TLS context) now, not in the first drain."""
        await self.available()

    async def available(self) -> bool:
        """Whether the runtime sends this process's requests: False where botocore's settings
        it cannot follow apply (logged once, when first found)."""
        if self._client is None and self.unusable is None:
            async with self._lock:
                if self._client is None and self.unusable is None:
                    await self._build()
        return self.unusable is None

    async def _build(self) -> None:
        from awscrt import io, s3

        botocore = await self._owner._s3()
        endpoint = str(botocore.meta.endpoint_url)  # as botocore resolved it (FIPS, env, ...)
        self.unusable = _unfollowable(botocore, endpoint)
        if self.unusable is not None:
            log_event(log, logging.WARNING, "s3_crt_engine_unused", reason=self.unusable)
            return
        parts = urlsplit(endpoint)
        style = self._config.addressing_style
        bucket = self._config.bucket
        virtual = style == "virtual" or (
            style == "auto" and self._config.endpoint_url is None and "." not in bucket)
        self._host = f"{bucket}.{parts.netloc}" if virtual else parts.netloc
        self._base = parts.path.rstrip("/") + ("/" if virtual else f"/{quote(bucket, safe='')}/")
        with self._owner._translating("reading the credentials"):
            await self._credentials()
        from awscrt.exceptions import AwsCrtError

        tls = parts.scheme == "https"
        bundle = self._owner._session.get_config_variable("ca_bundle")
        try:
            trust = None
            if tls and bundle:  # botocore's AWS_CA_BUNDLE / ca_bundle, not the system's
                options = io.TlsContextOptions()
                options.override_default_trust_store_from_path(ca_filepath=str(bundle))
                trust = io.ClientTlsContext(options).new_connection_options()
            group = io.EventLoopGroup(_IO_THREADS)
            self._client = s3.S3Client(
                bootstrap=io.ClientBootstrap(group, io.DefaultHostResolver(group)),
                region=self._config.region,
                tls_mode=s3.S3RequestTlsMode.ENABLED if tls else s3.S3RequestTlsMode.DISABLED,
                tls_connection_options=trust,
                credential_provider=self._provider,
                max_active_connections_override=int(self._config.max_concurrency)
                + _HEAD_CONNECTIONS,
                retry_config=s3.S3RetryConfig(retry_mode=s3.S3RetryMode.NONE),
                connect_timeout_ms=int(float(self._config.connect_timeout_s) * 1000),
            )
        except (AwsCrtError, RuntimeError) as exc:  # awscrt raises both for bad arguments
            # A CA bundle it cannot read, no threads to be had: botocore sends these requests
            # (and says what is wrong with the bundle, if that is it).
            self.unusable = f"the runtime could not start ({exc})"
            log_event(log, logging.WARNING, "s3_crt_engine_unused", reason=self.unusable)

    async def _credentials(self) -> None:
        """The credentials botocore's chain resolves (environment, profile, instance role),
        frozen now: refreshed ones (a role's) are picked up before each request."""
        from awscrt.auth import AwsCredentialsProvider
        from botocore.exceptions import NoCredentialsError

        found = await self._owner._session.get_credentials()
        if found is None:
            raise NoCredentialsError()
        frozen = await found.get_frozen_credentials()
        key = (frozen.access_key, frozen.secret_key, frozen.token)
        if key != self._frozen:
            self._provider = AwsCredentialsProvider.new_static(*key)
            self._frozen = key

    async def put(self, what: str, full: str, fd: int, size: int, crc: int,
                  metadata: dict[str, str], exclusive: bool) -> str:
        """PutObject ``size`` bytes of ``fd`` (all of it) under ``full``, declaring its
        CRC64NVME ``crc`` (the server refuses a body that does not match it); the object's
        ETag ("" when the answer had none)."""
        headers = [("Host", self._host), ("Content-Length", str(size)),
                   ("Content-Type", "binary/octet-stream"),
                   ("x-amz-checksum-crc64nvme", crc64_header(crc))]
        headers += [(f"x-amz-meta-{name}", value) for name, value in metadata.items()]
        if exclusive:
            headers.append(("If-None-Match", "*"))
        answer = await self._send(what, "PutObject", "PUT", full, headers, fd, size)
        etag = next((value for name, value in answer if name.lower() == "etag"), "")
        if not etag:
            raise no_s3_answer(what, self._owner.uri)
        return etag

    async def head(self, what: str, full: str) -> dict[str, Any]:
        """HeadObject with its stored checksum, as botocore's answer (ContentLength,
        LastModified, ETag, Metadata, ChecksumCRC64NVME, ChecksumType)."""
        headers = await self._send(what, "HeadObject", "HEAD", full,
                                   [("Host", self._host), ("x-amz-checksum-mode", "ENABLED")])
        try:
            answer = head_answer(headers)
        except (KeyError, ValueError, TypeError) as exc:
            raise S3Failure(f"{what}: the answer was malformed ({type(exc).__name__}: {exc}); "
                            "it will be sent again", transient=True, kind="io") from exc
        if not answer.get("ETag"):
            raise no_s3_answer(what, self._owner.uri)
        return answer

    async def _send(self, what: str, operation: str, method: str, full: str,
                    headers: list[tuple[str, str]], fd: int | None = None, size: int = 0
                    ) -> list[tuple[str, str]]:
        """The answer's headers, after up to ``max_attempts`` attempts."""
        attempt, renewed = 0, False
        while True:
            attempt += 1
            try:
                return await self._attempt(what, operation, method, full, headers, fd, size)
            except S3Failure as exc:
                if (exc.kind == "auth" and not exc.transient and not renewed
                        and await self._owner.renew_credentials()):
                    # Credentials an operator fixed since they were resolved (S3Client's
                    # renew_credentials): sent again at once, signed with the new ones.
                    attempt, renewed = attempt - 1, True
                    continue
                if attempt >= self._attempts or not (exc.transient
                                                     and exc.kind in _RETRIED_KINDS):
                    raise
            await asyncio.sleep(random.uniform(0, min(_MAX_BACKOFF_S, 0.5 * 2 ** attempt)))

    async def _attempt(self, what: str, operation: str, method: str, full: str,
                       headers: list[tuple[str, str]], fd: int | None, size: int
                       ) -> list[tuple[str, str]]:
        from awscrt import http, s3
        from awscrt.exceptions import AwsCrtError

        with self._owner._translating(what):
            await self._credentials()
        client = self._client
        if client is None:  # closed meanwhile (the backend is stopping)
            raise BackendError(f"the S3 backend for {self._owner.uri} is closed", kind="io")
        answered: list[list[tuple[str, str]]] = []

        def on_headers(status_code: int, headers: list[tuple[str, str]], **_: Any) -> None:
            answered.append(headers)

        # The runtime opens the body by path; a duplicate of the caller's fd stays open until
        # the runtime has ended the request (even one we gave up on), so the path can never
        # name a file that reused the number.
        body = os.dup(fd) if fd is not None else None
        try:
            request = client.make_request(
                type=s3.S3RequestType.DEFAULT, operation_name=operation,
                request=http.HttpRequest(method, self.path(full), http.HttpHeaders(headers)),
                send_filepath=None if body is None else f"/proc/self/fd/{body}",
                credential_provider=self._provider, on_headers=on_headers)
        except BaseException as exc:
            if body is not None:
                os.close(body)
            if isinstance(exc, AwsCrtError):
                raise self._failure(what, operation, exc) from exc
            raise
        done = request.finished_future
        if body is not None:
            done.add_done_callback(lambda _: os.close(body))
        ended = asyncio.wrap_future(done)
        # A given-up attempt ends later with an error nobody else reads: read it here, or
        # asyncio logs "exception was never retrieved" for each one.
        ended.add_done_callback(_retrieve)
        try:
            async with asyncio.timeout(self._timeout_s + size / _SLOWEST_BYTES_PER_S):
                # Shielded: cancelling our wait must not cancel the runtime's future (its
                # callback would close the body while the runtime may still read it).
                await asyncio.shield(ended)
        except TimeoutError as exc:
            request.cancel()
            task = asyncio.current_task()
            cancels = task.cancelling() if task is not None else 0
            await outlast(ended, _END_GRACE_S)  # its body and connection, let go
            if task is not None and task.cancelling() > cancels:
                # Cancelled while the runtime let go (outlast holds cancels back): the caller
                # gave up, so this is no timeout to retry.
                raise asyncio.CancelledError from None
            raise self._failure(what, operation, exc) from exc
        except asyncio.CancelledError:
            request.cancel()
            await outlast(ended, _END_GRACE_S)
            raise
        except AwsCrtError as exc:
            raise self._failure(what, operation, exc) from exc
        if not answered:
            raise S3Failure(f"{what}: the answer had no headers; it will be sent again",
                            transient=True, kind="io")
        return answered[-1]

    def _failure(self, what: str, operation: str, exc: BaseException) -> S3Failure:
        """The S3Failure botocore's path would raise for the same answer."""
        status = getattr(exc, "status_code", None)
        named = _ANSWERS.get(str(getattr(exc, "name", "")))
        if not status and named is not None:
            # Answers the runtime reports by its own error name, without their status.
            exc = ClientError({"Error": {"Code": named[0], "Message": str(exc)},
                               "ResponseMetadata": {"HTTPStatusCode": named[1]}}, operation)
        elif status:
            raw = getattr(exc, "body", None) or b""
            code = _CODE.search(raw)
            message = _MESSAGE.search(raw)
            exc = ClientError({
                "Error": {"Code": code.group(1).decode("ascii", "replace") if code
                          else str(status),
                          "Message": message.group(1).decode("utf-8", "replace") if message
                          else getattr(exc, "name", "")},
                "ResponseMetadata": {"HTTPStatusCode": int(status)}}, operation)
        elif not isinstance(exc, TimeoutError):
            name = str(getattr(exc, "name", type(exc).__name__))
            detail = f"{name}: {getattr(exc, 'message', exc)}"
            # No answer came back: the network, as botocore's connection errors.
            exc = TimeoutError(detail) if "TIMEOUT" in name else ConnectionError(detail)
        return self._owner._failure(what, exc)

    async def aclose(self) -> None:
        # The runtime's client ends its threads when it is collected; every request of ours
        # has ended by now (each waits for its own end).
        self._client = None
        self.unusable = "closed"


def _unfollowable(botocore: Any, endpoint: str) -> str | None:
    """What botocore would do for ``endpoint`` that the runtime cannot: None when nothing."""
    http = getattr(getattr(botocore, "_endpoint", None), "http_session", None)
    proxies = getattr(http, "_proxy_config", None)
    if proxies is not None:
        proxy = proxies.proxy_url_for(endpoint)
    else:  # botocore's internals differ: the environment, as botocore reads it
        host = urlsplit(endpoint).hostname or ""
        proxy = None if urllib.request.proxy_bypass(host) else urllib.request.getproxies().get(
            urlsplit(endpoint).scheme)
    if proxy:
        return f"requests to {endpoint} go through a proxy ({proxy})"
    return None


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def head_answer(headers: list[tuple[str, str]]) -> dict[str, Any]:
    """A HEAD's response headers as botocore's head_object answer (ValueError: malformed)."""
    by_name = {name.lower(): value for name, value in headers}
    answer: dict[str, Any] = {
        "ContentLength": int(by_name["content-length"]),
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
