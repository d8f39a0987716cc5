"""What a generation shows in `status` while its drains or commit retry a destination error."""

from __future__ import annotations

from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.records import SUMMARY_ERROR_CHARS, retrying_note


def test_a_long_message_is_cut_and_the_try_count_kept() -> None:
    # Found when the suite first ran in two workers: their temp paths are longer, and the
    # note, cut from its end, lost "(try N, retrying)".
    exc = BackendError("the destination root /lustre/" + "deep/" * 80 + " is missing", kind="io")
    note = retrying_note(exc, 3)
    assert len(note) == SUMMARY_ERROR_CHARS
    assert note.startswith("io: the destination root /lustre/deep/")
    assert note.endswith("… (try 3, retrying)")


def test_a_short_message_is_shown_whole() -> None:
    assert retrying_note(BackendError("slow down", kind="throttled"), 1) == (
        "throttled: slow down (try 1, retrying)")
