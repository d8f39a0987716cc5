"""How S3 failures become BackendErrors: the error codes, whether a retry can help, and
the one sentence an operator reads to fix it."""

from __future__ import annotations

import asyncio

import aiohttp
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    CredentialRetrievalError,
    FlexibleChecksumError,
    NoCredentialsError,
    ParamValidationError,
    PartialCredentialsError,
    ReadTimeoutError,
)

from ckptdrain.daemon.backends.base import BackendError

_THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "TooManyRequestsException", "RequestThrottled", "RequestThrottledException",
    "BandwidthLimitExceeded", "ServiceUnavailable",
})
_TIMEOUT_CODES = frozenset({"RequestTimeout", "RequestTimeoutException"})
_AUTH_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
    "AllAccessDisabled", "AccountProblem", "InvalidSecurity", "AuthorizationHeaderMalformed",
    "RequestTimeTooSkewed",
})
# Expired temporary credentials are refreshed by the credential chain on the next attempt.
_AUTH_TRANSIENT_CODES = frozenset({"ExpiredToken", "TokenRefreshRequired"})
_INTEGRITY_CODES = frozenset({
    "BadDigest", "XAmzContentSHA256Mismatch", "InvalidDigest", "IncompleteBody",
})
_NOT_FOUND_CODES = frozenset({"NoSuchBucket", "NoSuchKey", "NoSuchUpload", "NotFound"})
_CONFLICT_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict",
                             "OperationAborted", "InvalidPart", "InvalidPartOrder"})

# Everything a call through aiobotocore can raise for a reason outside our own code.
S3_FAILURES: tuple[type[BaseException], ...] = (
    BotoCoreError, ClientError, aiohttp.ClientError, ConnectionError, TimeoutError,
)


class S3Failure(BackendError):
    """A failed S3 request; ``code`` is the S3 error code ("" when no response came back)."""

    def __init__(self, message: str, *, transient: bool, kind: str, code: str = "",
                 status: int = 0) -> None:
        super().__init__(message, transient=transient, kind=kind)
        self.code = code
        self.status = status


def classify(exc: BaseException) -> tuple[bool, str]:
    """(transient, kind) for an exception raised by aiobotocore/botocore/aiohttp."""
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in _THROTTLE_CODES or status in (429, 503):
            return True, "throttled"
        if code in _TIMEOUT_CODES or status in (408, 504):
            return True, "timeout"
        if code in _AUTH_TRANSIENT_CODES:
            return True, "auth"
        if code in _AUTH_CODES or status in (401, 403):
            return False, "auth"
        if code == "BadDigest":
            # The bytes changed on the way (we computed the checksum from what we read).
            return True, "integrity"
        if code == "MalformedXML":
            # The XML bodies we send (a Complete's parts, a DeleteObjects' keys) are botocore's
            # rendering of our parameters, and carry no checksum the server could check: one
            # byte flipped on the way failed a Complete, and its whole generation, for good
            # (found attacking the S3 drain). Sent again, within the drain's retry budget.
            return True, "integrity"
        if code in _INTEGRITY_CODES:
            return False, "integrity"
        if code in _NOT_FOUND_CODES or status == 404:
            return False, "not_found"
        if code == "ConditionalRequestConflict":
            return True, "conflict"
        if code in _CONFLICT_CODES or status in (409, 412):
            return False, "conflict"
        if status >= 500 or code in ("InternalError", "ServiceUnavailable"):
            return True, "io"
        return False, "io"
    if isinstance(exc, ConnectTimeoutError | ReadTimeoutError | TimeoutError):
        return True, "timeout"
    if isinstance(exc, NoCredentialsError | PartialCredentialsError | CredentialRetrievalError):
        return False, "auth"
    if isinstance(exc, FlexibleChecksumError):
        return True, "integrity"
    if isinstance(exc, ParamValidationError):
        return False, "io"
    # Connection refused/reset/closed, a short body, a DNS failure: the network, not the data.
    return True, "io"


# Operations whose every S3 answer names the object's (or part's) ETag. A 200 without one is
# no S3 server's answer: a web server or a proxy's page answering at the endpoint. Taken for a
# PutObject that landed, it dropped the only copy of an acknowledged shard, and the generation
# could never commit; taken for a GET or a HEAD, an HTML page was a damaged manifest or another
# attempt's shard, which failed the step for good (found attacking the S3 drain).
ANSWERED_WITH_ETAG = frozenset({"put_object", "upload_part", "complete_multipart_upload",
                                "get_object", "head_object"})


def no_s3_answer(what: str, uri: str) -> S3Failure:
    """The transient failure of a request answered without the ETag every S3 answer has."""
    return S3Failure(
        f"{what} at {uri}: the server answered without an ETag, which every S3 server gives: "
        "not an S3 answer (a web server, a proxy or a load balancer answering at "
        "destination.endpoint_url?); nothing is taken as written or read, and it is sent "
        "again while drain.retry_budget_s lasts", transient=True, kind="io")


def advice(kind: str, transient: bool, endpoint: str, code: str = "") -> str:
    if code == "MalformedXML":
        # (An integrity kind, retried, but no checksum was refused: found attacking.)
        return ("the server could not parse the XML sent to it: changed on the way (it is "
                "retried within drain.retry_budget_s), or a server that does not take it")
    if kind == "throttled":
        return "the store is throttling: lower destination.max_concurrency or wait"
    if kind == "timeout":
        return (f"no answer from {endpoint} in time: check the network path or raise "
                "destination.read_timeout_s / connect_timeout_s")
    if kind == "auth":
        return ("check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
                "the instance role), the bucket policy and the clock")
    if kind == "integrity":
        return "the server refused the body's checksum: the bytes changed in transit; retry"
    if kind == "not_found":
        return "check destination.uri (bucket and prefix) and that the bucket exists"
    if kind == "conflict":
        return "another writer got there first or is writing the same key"
    if transient:
        return f"check that {endpoint} is reachable (destination.endpoint_url) and healthy"
    return "the request was refused; see the S3 error code"


def first_cause(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error to raise for a failed set of parts: cancellation first, then a permanent
    failure (retrying cannot help), then any other."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    for exc in leaves:
        if isinstance(exc, asyncio.CancelledError):
            return exc
    for exc in leaves:
        if isinstance(exc, BackendError) and not exc.transient:
            return exc
    for exc in leaves:
        if not isinstance(exc, BackendError):
            return exc
    return leaves[0]
