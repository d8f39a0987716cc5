"""What a generation's status summary shows of a long error: its start and its end."""

from __future__ import annotations

import time

from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.records import (
    MAX_ERROR_CHARS,
    SUMMARY_ERROR_CHARS,
    GenerationRecord,
    cap_error,
    retrying_note,
)


def test_a_long_retried_error_is_cut_in_the_middle_and_keeps_its_try_count() -> None:
    # Found when the suite first ran in two workers: their temp paths are longer, and the
    # note, cut at its end, lost "(try N, retrying)".
    exc = BackendError("the destination root /lustre/" + "deep/" * 80 + " is missing",
                       kind="io")
    note = retrying_note(exc, 3)
    assert len(note) == SUMMARY_ERROR_CHARS
    assert note.startswith("io: the destination root /lustre/deep/")
    assert note.endswith("/ is missing (try 3, retrying)") and "…" in note


def test_a_short_retried_error_is_shown_whole() -> None:
    assert retrying_note(BackendError("slow down", kind="throttled"), 1) == (
        "throttled: slow down (try 1, retrying)")


def test_a_long_failure_keeps_what_to_do_in_status() -> None:
    gen = GenerationRecord(job="j", step=1, world_size=1, ack="local", created_at=time.time())
    gen.error = ("shard a.bin at /lustre/" + "deep/" * 80 + " is damaged: restore an older "
                 "generation (`ckptdrain ls` lists them)")
    shown = gen.summary()["error"]
    assert len(shown) == SUMMARY_ERROR_CHARS
    assert shown.startswith("shard a.bin at /lustre/deep/")
    assert shown.endswith("restore an older generation (`ckptdrain ls` lists them)")


def test_an_error_kept_in_the_journal_is_bounded_and_keeps_its_end() -> None:
    kept = cap_error("x" * 5000 + " retry with `ckptdrain retry`")
    assert len(kept) == MAX_ERROR_CHARS and kept.endswith("retry with `ckptdrain retry`")
