"""The head of a ranged GET's answer: whether its body is read straight into a buffer
(s3rangeget.py) or the range is asked again through aiobotocore (NotPlain)."""

from __future__ import annotations

import pytest
from botocore.auth import _host_from_url

from ckptdrain.daemon.backends.s3rangeget import (
    BUFFER_BYTES,
    NotPlain,
    Route,
    is_plain,
    parse_head,
    signed_host,
)

ASKED = "bytes 8-15/"
PLAIN = (b"HTTP/1.1 206 Partial Content\r\nContent-Length: 8\r\n"
         b"Content-Range: bytes 8-15/100\r\nETag: \"e\"\r\nServer: x")


def test_a_plain_answer_is_read_here() -> None:
    head = parse_head(PLAIN)
    assert head.status == 206 and head.fields["content-range"] == "bytes 8-15/100"
    assert is_plain(head, ASKED, 8)


@pytest.mark.parametrize("raw", [
    PLAIN.replace(b"206 Partial Content", b"200 OK"),          # the whole object
    PLAIN.replace(b"206 Partial Content", b"412 Precondition Failed"),
    PLAIN.replace(b"Content-Length: 8", b"Content-Length: 9"),  # not the range's length
    PLAIN.replace(b"bytes 8-15/100", b"bytes 0-7/100"),        # another range
    PLAIN.replace(b"Content-Length: 8", b"Transfer-Encoding: chunked"),
    PLAIN + b"\r\nContent-Encoding: gzip",
    PLAIN.replace(b"Content-Range: bytes 8-15/100\r\n", b""),
])
def test_anything_else_is_asked_again_through_aiobotocore(raw: bytes) -> None:
    assert not is_plain(parse_head(raw), ASKED, 8)


@pytest.mark.parametrize("raw", [
    b"SSH-2.0-OpenSSH_9",
    b"HTTP/2 206",
    b"HTTP/1.1 2x6 Partial",
    PLAIN + b"\r\nno colon here",
    PLAIN + b"\r\n folded: value",
    PLAIN + b"\r\nContent-Length: 8",  # the same field twice: which one frames the body?
])
def test_a_head_that_is_not_http_1_is_not_plain(raw: bytes) -> None:
    with pytest.raises(NotPlain):
        parse_head(raw)


def test_a_batch_is_not_a_whole_number_of_pages() -> None:
    # Page-aligned batches put the restored file in large page-cache folios, which cost three
    # to five times the system CPU on a VM whose host takes free memory back (the module says
    # how it was measured).
    assert BUFFER_BYTES % 4096 != 0 and 128 << 10 < BUFFER_BYTES <= 256 << 10


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8333/b/k?X-Amz-Signature=0", "http://LocalHost:8333/b/k",
    "https://S3.Example.com:443/b/k", "http://s3.example.com:80/b/k",
    "https://s3.example.com/b/k", "http://[::1]:8333/b/k", "http://[::1]:80/b/k",
    "https://bucket.s3.example.com:8443/k",
])
def test_the_host_sent_is_the_one_botocore_signed(url: str) -> None:
    # (A Host botocore did not sign is refused: SignatureDoesNotMatch, and the range is
    # asked again through aiobotocore, every time.)
    assert signed_host(url) == _host_from_url(url)


class _Proxies:
    """botocore's ProxyConfiguration as the route uses it: the proxy for a URL, recorded."""

    def __init__(self, proxied: str = "") -> None:
        self.proxied = proxied
        self.asked: list[str] = []

    def proxy_url_for(self, url: str) -> str | None:
        self.asked.append(url)
        return "http://proxy:3128" if self.proxied and self.proxied in url else None


@pytest.mark.parametrize(("url", "where"), [
    ("http://s3.example.com:8333/b/k?X-Amz-Signature=0", ("s3.example.com", 8333)),
    # A virtual-hosted bucket: sent to its own host, as aiobotocore sends it.
    ("http://bkt.s3.example.com:8333/k", ("bkt.s3.example.com", 8333)),
    ("http://s3.example.com/b/k", ("s3.example.com", 8333)),
    ("http://other.example.com:8333/b/k", None),   # not the endpoint's: aiobotocore's
    ("http://evils3.example.com:8333/b/k", None),
])
def test_a_presigned_url_goes_to_its_own_host_under_the_endpoints(
        url: str, where: tuple[str, int] | None) -> None:
    route = Route("s3.example.com", 8333, None, _Proxies())
    assert route.target(url) == where


def test_a_url_the_proxy_settings_send_through_a_proxy_is_not_read_here() -> None:
    proxies = _Proxies(proxied="bkt.")
    route = Route("s3.example.com", 8333, None, proxies)
    assert route.target("http://s3.example.com:8333/b/k") == ("s3.example.com", 8333)
    assert route.target("http://bkt.s3.example.com:8333/k") is None
    assert proxies.asked == ["http://s3.example.com:8333/b/k", "http://bkt.s3.example.com:8333/k"]
