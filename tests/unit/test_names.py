"""Accept/reject tables for job names, shard paths, steps, ranks and world sizes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptdrain.client import names
from ckptdrain.client.errors import InvalidName, RejectedInput

GOOD_JOBS = [
    "llama-70b",
    "a",
    "Job_1.2-x",
    "0",
    "a..b",
    "x" * names.MAX_JOB_BYTES,
]

BAD_JOBS = [
    ("", "empty"),
    ("a/b", "'/'"),
    ("../x", "'/'"),
    (".", "starts with '.'"),
    ("..", "starts with '.'"),
    (".hidden", "starts with '.'"),
    ("-rf", "starts with '-'"),
    ("a b", "' '"),
    ("a\x00b", "U+0000"),
    ("a\nb", "U+000A"),
    ("jöb", "'ö'"),
    ("a\\b", "'\\\\'"),
    ("x" * (names.MAX_JOB_BYTES + 1), "over the limit"),
    ("\ud800", "U+D800"),
]

GOOD_PATHS = [
    "model/rank3.pt",
    "__0_0.distcp",
    ".metadata",  # DCP's own metadata file name
    "a/b/c/d.bin",
    "x+y=z,w@v-1",
    "a" * names.MAX_COMPONENT_BYTES,
    "/".join(["a" * 200] * 5),  # 1004 bytes, under the limit
    "MANIFEST.json.bak",
    "dir/MANIFEST.json",
    "parts/x",
    "_partsx/y",
    "x.ckptdrain-tmp.bin",
]

BAD_PATHS = [
    ("", "empty"),
    ("../x", "'..'"),
    ("a/../b", "'..'"),
    ("a/./b", "'.'"),
    ("..", "'..'"),
    ("/etc/passwd", "absolute"),
    ("a//b", "empty component"),
    ("a/", "empty component"),
    ("a\x00b", "NUL"),
    ("a\\b", "backslash"),
    ("..\\..\\x", "backslash"),
    ("a\tb", "U+0009"),
    ("a\x7fb", "U+007F"),
    ("a b", "' '"),
    ("ünïcode.pt", "'ü'"),
    ("model/\u202eexe.pt", "U+202E"),
    ("-x/y", "starting with '-'"),
    ("y/-x", "starting with '-'"),
    ("a:b", "':'"),
    ("a*b", "'*'"),
    ("a" * (names.MAX_COMPONENT_BYTES + 1), "component too long: 256 bytes"),
    ("/".join(["a" * 200] * 6), "over the limit"),
    ("MANIFEST.json", "reserved"),
    ("MANIFEST.json/x", "reserved"),
    ("_parts/node1.json", "_parts/"),
    ("_parts", "_parts/"),
    ("x.ckptdrain-tmp", ".ckptdrain-tmp"),
    ("a.ckptdrain-tmp/b", ".ckptdrain-tmp"),
]


@pytest.mark.parametrize("job", GOOD_JOBS)
def test_good_job_names_are_returned_unchanged(job: str) -> None:
    assert names.validate_job(job) == job


@pytest.mark.parametrize(("job", "why"), BAD_JOBS)
def test_bad_job_names_raise_invalid_name_saying_why(job: str, why: str) -> None:
    with pytest.raises(InvalidName) as info:
        names.validate_job(job)
    assert why in info.value.message
    assert info.value.code == "invalid_name"


def test_job_name_message_names_the_problem_and_the_rule() -> None:
    with pytest.raises(InvalidName, match=r"job name 'a/b' contains '/'; use letters, digits"):
        names.validate_job("a/b")


@pytest.mark.parametrize("value", [None, 3, b"job", ["job"]])
def test_non_string_job_names_are_rejected(value: object) -> None:
    with pytest.raises(InvalidName, match="must be a string"):
        names.validate_job(value)


@pytest.mark.parametrize("path", GOOD_PATHS)
def test_good_shard_paths_are_returned_unchanged(path: str) -> None:
    assert names.validate_shard_path(path) == path


@pytest.mark.parametrize(("path", "why"), BAD_PATHS)
def test_bad_shard_paths_raise_invalid_name_saying_why(path: str, why: str) -> None:
    with pytest.raises(InvalidName) as info:
        names.validate_shard_path(path)
    assert why in info.value.message


@pytest.mark.parametrize("value", [None, 7, b"model.pt", ("a",)])
def test_non_string_shard_paths_are_rejected(value: object) -> None:
    with pytest.raises(InvalidName, match="must be a string"):
        names.validate_shard_path(value)


def test_path_length_counts_utf8_bytes_not_characters() -> None:
    # 600 two-byte characters: 600 characters but 1200 bytes, over the limit before charset.
    with pytest.raises(InvalidName, match="1200 bytes"):
        names.validate_shard_path("é" * 600)


@pytest.mark.parametrize("step", [0, 1, 1200, names.MAX_STEP])
def test_good_steps(step: int) -> None:
    assert names.validate_step(step) == step


@pytest.mark.parametrize(
    ("step", "why"),
    [
        (-1, "out of range"),
        (names.MAX_STEP + 1, "out of range"),
        (True, "must be an integer"),
        (1.0, "must be an integer"),
        ("3", "must be an integer"),
        (None, "must be an integer"),
    ],
)
def test_bad_steps_raise_rejected_input(step: object, why: str) -> None:
    with pytest.raises(RejectedInput, match=why) as info:
        names.validate_step(step)
    assert not isinstance(info.value, InvalidName)


@pytest.mark.parametrize("world_size", [1, 8, names.MAX_WORLD_SIZE])
def test_good_world_sizes(world_size: int) -> None:
    assert names.validate_world_size(world_size) == world_size


@pytest.mark.parametrize("world_size", [0, -1, names.MAX_WORLD_SIZE + 1, False, 2.0, "8"])
def test_bad_world_sizes(world_size: object) -> None:
    with pytest.raises(RejectedInput, match="world_size"):
        names.validate_world_size(world_size)


@pytest.mark.parametrize(("rank", "world_size"), [(0, 1), (7, 8), (999_999, 1_000_000)])
def test_good_ranks(rank: int, world_size: int) -> None:
    assert names.validate_rank(rank, world_size) == rank


@pytest.mark.parametrize(
    ("rank", "world_size", "why"),
    [
        (1, 1, "use 0..0"),
        (8, 8, "use 0..7"),
        (-1, 8, "out of range"),
        (True, 8, "must be an integer"),
        (0, 0, "world_size 0 is out of range"),
        (0, True, "world_size must be an integer"),
    ],
)
def test_bad_ranks(rank: object, world_size: object, why: str) -> None:
    with pytest.raises(RejectedInput, match=why):
        names.validate_rank(rank, world_size)


@given(st.text(alphabet=st.sampled_from("aZ09._-+=,@/\\ \n\x00é\ud800"), max_size=12)
       | st.text(max_size=12))
def test_the_whole_name_match_finds_what_a_scan_of_each_character_finds(text: str) -> None:
    # Names are matched whole (one regex call) and scanned only to report a bad character:
    # both must agree on every string, newlines, NULs and surrogates included.
    for allowed in (names._JOB_CHARS, names._COMPONENT_CHARS):
        scanned = next((c for c in text if not allowed.fullmatch(c)), None)
        assert names._first_bad_char(text, allowed) == scanned


_PIECES = st.sampled_from(["a", "Z", "0", ".", "..", "-", "_", "+", "=", ",", "@", "/", "//",
                           "\\", "\x00", "\n", " ", "é", "\ud800", "_parts", "MANIFEST.json",
                           ".ckptdrain-tmp", "a" * 254, "b" * 300])


@given(st.lists(_PIECES, max_size=8).map("".join) | st.text(max_size=20))
def test_the_one_match_takes_exactly_the_paths_the_rules_take(path: str) -> None:
    # A shard path is matched whole (every path of every manifest read: `ls` of 100,000-shard
    # generations spent most of its time on the rules one by one); the rules then only say
    # what is wrong. The match may take no path the rules refuse, and should take every
    # path they accept (or the slow way is back).
    try:
        names._shard_path_rules(path)
        accepted = True
    except InvalidName:
        accepted = False
    assert names.is_plain_shard_path(path) == accepted, path
