"""Which job names, shard paths, steps and ranks are acceptable (pure; no I/O).

Names become directory names and object keys at the destination, so they are checked the same
way by the client (to fail fast, before any I/O) and by the daemon (because every client is
hostile until checked). The rules are deliberately narrow: a safe ASCII charset means a name
means the same thing on Lustre, in an S3 key, in a URL and in a shell.
"""

from __future__ import annotations

import operator
import re

from ckptdrain.client.errors import InvalidName, RejectedInput

MAX_JOB_BYTES = 128
MAX_PATH_BYTES = 1024
# The usual NAME_MAX of Linux filesystems, Lustre included.
MAX_COMPONENT_BYTES = 255
MAX_WORLD_SIZE = 1_000_000
# Every layer stores a step as a signed 64-bit integer (the daemon's SQLite journal, C and
# Go readers of the manifest); the destination zero-pads it to 20 digits, which always fit.
MAX_STEP = 2**63 - 1

# Names the destination layout uses itself inside a generation directory; a shard may not
# shadow them or the commit protocol could read a client's bytes as its own records.
MANIFEST_NAME = "MANIFEST.json"
PARTS_DIR = "_parts"
# POSIX writes every file under this suffix before renaming it into place.
TEMP_SUFFIX = ".ckptdrain-tmp"

_JOB_CHARS = re.compile(r"[A-Za-z0-9._-]")
_COMPONENT_CHARS = re.compile(r"[A-Za-z0-9._+=,@-]")
# The same sets for a whole name at once: one match in C where a name is good (the daemon
# checks every name again each time it builds a key from it), a scan only to name a bad char.
_WHOLE = {allowed: re.compile(f"{allowed.pattern}*") for allowed in (_JOB_CHARS, _COMPONENT_CHARS)}
_JOB_RULE = "use letters, digits, '.', '_', '-', not starting with '.' or '-'"
_PATH_RULE = (
    "use a relative '/'-separated path of letters, digits and '._+=,@-', "
    "no empty, '.' or '..' components, no component starting with '-'"
)


def _first_bad_char(text: str, allowed: re.Pattern[str]) -> str | None:
    if _WHOLE[allowed].fullmatch(text):
        return None
    for char in text:
        if not allowed.fullmatch(char):
            return char
    return None


def _show(char: str) -> str:
    """A bad character as the user can read it, control characters included."""
    return repr(char) if char.isprintable() else f"U+{ord(char):04X}"


def _utf8_len(text: str) -> int:
    # surrogatepass: a lone surrogate must yield a length (it is rejected by the charset next).
    return len(text.encode("utf-8", "surrogatepass"))


def validate_job(job: object) -> str:
    """Return ``job`` if it is an acceptable job name, else raise :class:`InvalidName`."""
    if not isinstance(job, str):
        raise InvalidName(f"job name must be a string, not {type(job).__name__}; {_JOB_RULE}")
    if not job:
        raise InvalidName(f"job name is empty; {_JOB_RULE}")
    size = _utf8_len(job)
    if size > MAX_JOB_BYTES:
        raise InvalidName(
            f"job name {job[:40]!r}... is too long: {size} bytes, over the limit of {MAX_JOB_BYTES}; "
            "use a shorter name"
        )
    bad = _first_bad_char(job, _JOB_CHARS)
    if bad is not None:
        raise InvalidName(f"job name {job!r} contains {_show(bad)}; {_JOB_RULE}")
    if job[0] in ".-":
        raise InvalidName(f"job name {job!r} starts with {job[0]!r}; {_JOB_RULE}")
    return job


# A shard path every rule of validate_shard_path accepts, in one match: its components of
# _COMPONENT_CHARS (ASCII: the path's length is its bytes), none empty, '.' or '..', starting
# with '-', longer than MAX_COMPONENT_BYTES or ending in TEMP_SUFFIX; the first not PARTS_DIR
# nor MANIFEST_NAME. Every path of every manifest read is checked (100,000 in a large one, on
# each `ls`): one match in C, and the rules one by one only for a path it does not take, to
# name what is wrong (`ls` of 100,000-shard generations spent most of its time here).
_COMPONENT = (rf"(?!-)(?!\.\.?(?:/|\Z)){_COMPONENT_CHARS.pattern}{{1,{MAX_COMPONENT_BYTES}}}"
              rf"(?<!{re.escape(TEMP_SUFFIX)})")
_PLAIN_PATH = re.compile(rf"(?!(?:{re.escape(PARTS_DIR)}|{re.escape(MANIFEST_NAME)})(?:/|\Z))"
                         rf"{_COMPONENT}(?:/{_COMPONENT})*")


def is_plain_shard_path(path: object) -> bool:
    """Whether ``path`` is a shard path validate_shard_path accepts, by one match; False says
    only that the rules must be checked one by one (a path with a character outside the
    plain set is refused there)."""
    return (type(path) is str and len(path) <= MAX_PATH_BYTES
            and _PLAIN_PATH.fullmatch(path) is not None)


def validate_shard_path(path: object) -> str:
    """Return ``path`` if it is an acceptable shard path, else raise :class:`InvalidName`."""
    if is_plain_shard_path(path):
        return path  # type: ignore[return-value]
    return _shard_path_rules(path)


def _shard_path_rules(path: object) -> str:
    """validate_shard_path, rule by rule: each refusal says what is wrong."""
    if not isinstance(path, str):
        raise InvalidName(f"shard path must be a string, not {type(path).__name__}; {_PATH_RULE}")
    if not path:
        raise InvalidName(f"shard path is empty; {_PATH_RULE}")
    size = _utf8_len(path)
    if size > MAX_PATH_BYTES:
        raise InvalidName(
            f"shard path {path[:40]!r}... is too long: {size} bytes, over the limit of {MAX_PATH_BYTES}; "
            "use a shorter path"
        )
    # The specific messages first: they tell the user what went wrong better than a charset.
    if "\x00" in path:
        raise InvalidName(f"shard path {path!r} contains a NUL byte; {_PATH_RULE}")
    if "\\" in path:
        raise InvalidName(f"shard path {path!r} contains a backslash; separate with '/'")
    if path.startswith("/"):
        raise InvalidName(f"shard path {path!r} is absolute; {_PATH_RULE}")
    components = path.split("/")
    for component in components:
        if component == "":
            raise InvalidName(
                f"shard path {path!r} has an empty component ('//' or a trailing '/'); {_PATH_RULE}"
            )
        if component in (".", ".."):
            raise InvalidName(
                f"shard path {path!r} contains a {component!r} component; {_PATH_RULE}"
            )
        bad = _first_bad_char(component, _COMPONENT_CHARS)
        if bad is not None:
            raise InvalidName(f"shard path {path!r} contains {_show(bad)}; {_PATH_RULE}")
        if component.startswith("-"):
            raise InvalidName(
                f"shard path {path!r} has a component starting with '-'; {_PATH_RULE}"
            )
        if len(component) > MAX_COMPONENT_BYTES:
            raise InvalidName(
                f"shard path {path[:40]!r}... has a component too long: {len(component)} bytes, over the "
                f"limit of {MAX_COMPONENT_BYTES}; use shorter file names"
            )
        if component.endswith(TEMP_SUFFIX):
            raise InvalidName(
                f"shard path {path!r} ends a component in {TEMP_SUFFIX!r}, which is reserved for "
                "ckptdrain's temporary files; rename the shard"
            )
    if components[0] == PARTS_DIR:
        raise InvalidName(
            f"shard path {path!r} is reserved: ckptdrain reserves {PARTS_DIR + '/'!r} for its "
            "part records; rename the shard"
        )
    if components[0] == MANIFEST_NAME:
        # Also as a directory: "MANIFEST.json/x" was taken, and its generation could never
        # commit (the manifest's exclusive create found a directory), failing as a conflict
        # that pages the operator (found attacking).
        raise InvalidName(
            f"shard path {path!r} is reserved for the generation manifest; rename the shard"
        )
    return path


def _exact_int(value: object, what: str) -> int:
    """``value`` as a plain int: an int, or any integer type (``__index__``: numpy's int64, a
    0-d integer tensor), which a training loop's step or rank often is; refused as such they
    failed with "step must be an integer, not int64" (found attacking the client). Never a
    float, and never a bool: True as a step is a caller bug, not step 1."""
    # numpy's bool and a 0-d bool tensor index as 0 and 1: refused by their dtype.
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        raise RejectedInput(f"{what} must be an integer, not {type(value).__name__}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise RejectedInput(f"{what} must be an integer, not {type(value).__name__}") from None


def validate_step(step: object) -> int:
    """Return ``step`` if it is an int in ``0..MAX_STEP``, else raise :class:`RejectedInput`."""
    value = _exact_int(step, "step")
    if not 0 <= value <= MAX_STEP:
        raise RejectedInput(f"step {value} is out of range; use 0..{MAX_STEP}")
    return value


def validate_world_size(world_size: object) -> int:
    """Return ``world_size`` if it is an int in ``1..MAX_WORLD_SIZE``, else raise."""
    value = _exact_int(world_size, "world_size")
    if not 1 <= value <= MAX_WORLD_SIZE:
        raise RejectedInput(f"world_size {value} is out of range; use 1..{MAX_WORLD_SIZE}")
    return value


def validate_rank(rank: object, world_size: object) -> int:
    """Return ``rank`` if ``0 <= rank < world_size`` (world_size itself valid), else raise."""
    size = validate_world_size(world_size)
    value = _exact_int(rank, "rank")
    if not 0 <= value < size:
        raise RejectedInput(
            f"rank {value} is out of range for world_size {size}; use 0..{size - 1}"
        )
    return value
