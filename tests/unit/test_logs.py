"""Structured logs: one line per event, quoting, journald prefix, redaction, rate limiting."""

from __future__ import annotations

import io
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptdrain.daemon.logs import (
    KeyValueFormatter,
    OncePerCause,
    format_fields,
    log_event,
    setup_logging,
)

TS = r"ts=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z "


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """setup_logging changes the root logger; put it back for the tests that follow."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    chatty = {name: logging.getLogger(name).level for name in ("botocore", "asyncio")}
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)
    for name, lvl in chatty.items():
        logging.getLogger(name).setLevel(lvl)


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_one_line_per_event(restore_logging: None) -> None:
    stream = io.StringIO()
    setup_logging("info", stream=stream, journald=False)
    log = logging.getLogger("ckptdrain.test.one")
    log_event(log, "info", "generation_committed", job="llama", step=1200, shards=8, bytes=1234)
    (line,) = lines(stream)
    assert re.fullmatch(
        TS + "level=info event=generation_committed job=llama step=1200 shards=8 bytes=1234", line
    )


def test_values_are_quoted_when_needed() -> None:
    text = format_fields(
        {
            "plain": "abc",
            "space": "a b",
            "eq": "a=b",
            "quote": 'say "hi"',
            "newline": "one\ntwo",
            "empty": "",
            "none": None,
            "yes": True,
            "ratio": 0.1 + 0.2,
            "path": Path("/var/lib/x"),
            "err": ValueError("bad thing"),
            "items": [1, 2],
            "lead": '"x',
            "json": {"a": "b"},
        }
    )
    assert text == (
        'plain=abc space="a b" eq="a=b" quote="say \\"hi\\"" newline="one\\ntwo" empty="" '
        'none=null yes=true ratio=0.3 path=/var/lib/x err="ValueError: bad thing" items=[1,2] '
        'lead="\\"x" json={"a":"b"}'
    )


def test_multiline_values_stay_on_one_line(restore_logging: None) -> None:
    stream = io.StringIO()
    setup_logging("debug", stream=stream, journald=False)
    log = logging.getLogger("ckptdrain.test.multi")
    try:
        raise RuntimeError("disk\nfull")
    except RuntimeError:
        log_event(log, "error", "drain_failed", exc_info=True, shard="a b")
    (line,) = lines(stream)
    assert 'error="RuntimeError: disk\\nfull"' in line
    assert 'traceback="Traceback (most recent call last):' in line
    assert 'shard="a b"' in line


def test_plain_library_records_are_formatted_too(restore_logging: None) -> None:
    stream = io.StringIO()
    setup_logging("info", stream=stream, journald=False)
    logging.getLogger("somelib").warning("retrying %s in %d s", "PUT", 3)
    (line,) = lines(stream)
    assert re.fullmatch(TS + 'level=warning event=log logger=somelib msg="retrying PUT in 3 s"',
                        line)


def test_secrets_are_never_written(restore_logging: None) -> None:
    stream = io.StringIO()
    setup_logging("info", stream=stream, journald=False)
    log = logging.getLogger("ckptdrain.test.secret")
    log_event(
        log,
        "info",
        "s3_configured",
        aws_secret_access_key="AKIASECRETVALUE1",
        aws_access_key_id="AKIAIDVALUE2",
        session_token="tok3",
        db_password="pw4",
        client_secret="cs5",
        Authorization="Bearer tok6",
        endpoint="http://admin:hunter7@127.0.0.1:8333/",
        nested={"inner": {"api_token": "tok8"}, "ok": 1},
        key="job/00000000000000001200/model.pt",
    )
    (line,) = lines(stream)
    for secret in ("SECRETVALUE1", "IDVALUE2", "tok3", "pw4", "cs5", "tok6", "hunter7", "tok8"):
        assert secret not in line
    assert "aws_secret_access_key=***" in line
    assert "aws_access_key_id=***" in line
    assert "endpoint=http://***@127.0.0.1:8333/" in line
    assert 'nested={"inner":{"api_token":"***"},"ok":1}' in line
    # An object key is not a secret: only secret-looking names are masked.
    assert "key=job/00000000000000001200/model.pt" in line


def test_journald_prefix_replaces_timestamp(restore_logging: None) -> None:
    stream = io.StringIO()
    setup_logging("debug", stream=stream, env={"JOURNAL_STREAM": "8:12345"})
    log = logging.getLogger("ckptdrain.test.journal")
    log_event(log, "debug", "d")
    log_event(log, "info", "i")
    log_event(log, "warning", "w")
    log_event(log, "error", "e")
    log_event(log, logging.CRITICAL, "c")
    assert lines(stream) == [
        "<7>level=debug event=d",
        "<6>level=info event=i",
        "<4>level=warning event=w",
        "<3>level=error event=e",
        "<2>level=critical event=c",
    ]


def test_journald_detection_checks_the_stream(tmp_path: Path, restore_logging: None) -> None:
    with open(tmp_path / "log", "w") as real:
        st = os.fstat(real.fileno())
        setup_logging("info", stream=real, env={"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        log_event(logging.getLogger("ckptdrain.test.j1"), "info", "matched")
        real.flush()
        # Inherited variable, different stream: not journald.
        setup_logging("info", stream=real, env={"JOURNAL_STREAM": "1:1"})
        log_event(logging.getLogger("ckptdrain.test.j2"), "info", "other")
        setup_logging("info", stream=real, env={})
        log_event(logging.getLogger("ckptdrain.test.j3"), "info", "unset")
    first, second, third = (tmp_path / "log").read_text().splitlines()
    assert first == "<6>level=info event=matched"
    assert re.fullmatch(TS + "level=info event=other", second)
    assert re.fullmatch(TS + "level=info event=unset", third)


def test_level_filters_and_setup_is_idempotent(restore_logging: None) -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    before = len(root.handlers)
    setup_logging("warning", stream=stream, journald=False)
    setup_logging("warning", stream=stream, journald=False)
    assert len(root.handlers) == before + 1
    log = logging.getLogger("ckptdrain.test.level")
    log_event(log, "info", "hidden")
    log_event(log, "warning", "shown")
    assert [line.split(" ", 1)[1] for line in lines(stream)] == ["level=warning event=shown"]
    # Libraries that log per request stay at INFO or above even when the daemon runs at debug.
    setup_logging("debug", stream=stream, journald=False)
    assert logging.getLogger("botocore").level == logging.INFO


def test_unknown_level_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        setup_logging("loud", stream=io.StringIO())
    with pytest.raises(ValueError, match="unknown log level"):
        log_event(logging.getLogger("ckptdrain.test.x"), "loud", "e")


def test_other_handlers_see_the_rendered_fields(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ckptdrain.test.caplog"):
        log_event(logging.getLogger("ckptdrain.test.caplog"), "info", "shard_staged", path="a b",
                  token="t0p")
    (record,) = caplog.records
    assert record.getMessage() == 'event=shard_staged path="a b" token=***'
    assert record.funcName == "test_other_handlers_see_the_rendered_fields"


def test_formatter_directly() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello world", None, None)
    assert KeyValueFormatter(journald=True).format(record) == (
        '<6>level=info event=log logger=x msg="hello world"'
    )


# ---------------------------------------------------------------------------------------------
# OncePerCause


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_once_per_cause_logs_first_then_once_per_interval() -> None:
    clock = FakeClock()
    once = OncePerCause(60.0, clock=clock)
    assert once.should_log("s3:timeout")
    assert [once.should_log("s3:timeout") for _ in range(5)] == [False] * 5
    assert once.pending("s3:timeout") == 5
    assert once.should_log("posix:io")  # another cause is independent
    clock.now += 59.9
    assert not once.should_log("s3:timeout")
    clock.now += 0.1
    assert once.should_log("s3:timeout")
    assert once.suppressed("s3:timeout") == 6
    assert once.pending("s3:timeout") == 0
    clock.now += 60
    assert once.should_log("s3:timeout")
    assert once.suppressed("s3:timeout") == 0


def test_once_per_cause_reset_and_bound() -> None:
    clock = FakeClock()
    once = OncePerCause(60.0, clock=clock, max_causes=2)
    assert once.should_log("a")
    assert not once.should_log("a")
    once.reset("a")
    assert once.should_log("a")  # cleared up, so the next failure logs at once
    assert once.should_log("b")
    assert once.should_log("c")  # evicts "a", the least recently seen
    assert once.should_log("a")
    assert not once.should_log("c")
    with pytest.raises(ValueError):
        OncePerCause(-1)
    with pytest.raises(ValueError):
        OncePerCause(max_causes=0)


def test_once_per_cause_logs_suppressed_count(restore_logging: None) -> None:
    stream = io.StringIO()
    setup_logging("info", stream=stream, journald=True)
    clock = FakeClock()
    once = OncePerCause(60.0, clock=clock)
    log = logging.getLogger("ckptdrain.test.once")
    results = []
    for _ in range(100):
        results.append(
            once.log_event(log, "warning", "drain_error", cause="s3:throttled", kind="throttled")
        )
    clock.now += 61
    results.append(
        once.log_event(log, "warning", "drain_error", cause="s3:throttled", kind="throttled")
    )
    assert results.count(True) == 2
    assert lines(stream) == [
        "<4>level=warning event=drain_error kind=throttled",
        "<4>level=warning event=drain_error kind=throttled suppressed=99",
    ]


def test_once_per_cause_with_a_burst_then_one_per_interval() -> None:
    clock = FakeClock()
    bucket = OncePerCause(1.0, burst=3, clock=clock)
    assert [bucket.should_log("uid 7") for _ in range(5)] == [True, True, True, False, False]
    assert bucket.should_log("uid 8")  # another uid has its own bucket
    clock.now += 0.5
    assert not bucket.should_log("uid 7")
    clock.now += 0.5
    assert bucket.should_log("uid 7")
    assert bucket.suppressed("uid 7") == 3
    assert not bucket.should_log("uid 7")
    clock.now += 10  # refills up to the burst, no further
    assert [bucket.should_log("uid 7") for _ in range(4)] == [True, True, True, False]
    with pytest.raises(ValueError):
        OncePerCause(burst=0)
