"""Loading the configuration: the TOML file or the embedded default, then the environment.

Precedence, lowest first: field defaults (the systemd install: ``/run/ckptdrain.sock``,
``/var/lib/ckptdrain``), then either the TOML file (``--config PATH`` or ``$CKPTDRAIN_CONFIG``)
or, when there is no file, the embedded default (per-user directories, no root needed), then
``CKPTDRAIN_<KEY>`` / ``CKPTDRAIN_<SECTION>__<KEY>`` environment variables. Every problem
becomes a :class:`ConfigError` that names the dotted key and says how to fix it; pydantic's own
error text never reaches an operator (the CLI maps ConfigError to exit code 78, ``EX_CONFIG``).
"""

from __future__ import annotations

import difflib
import json
import os
import stat
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ckptdrain.daemon.config import (
    AccessConfig,
    Config,
    DestinationConfig,
    DrainConfig,
    LimitsConfig,
    MetricsConfig,
    RetentionConfig,
)
from ckptdrain.daemon.errors import ConfigError
from ckptdrain.daemon.sizes import as_written, human_bytes

__all__ = [
    "ENV_IGNORED",
    "ENV_IGNORED_PREFIXES",
    "ENV_PREFIX",
    "default_socket_path",
    "embedded_default",
    "env_overrides",
    "load_config",
    "with_limits_from",
]

ENV_PREFIX = "CKPTDRAIN_"
# Variables in our namespace that are not config keys: where the config lives, and names that
# tests and tooling use for themselves.
ENV_IGNORED = frozenset({"CKPTDRAIN_CONFIG", "CKPTDRAIN_HOME"})
ENV_IGNORED_PREFIXES = ("CKPTDRAIN_TEST_",)


# ---------------------------------------------------------------------------------------------
# Loading


def default_socket_path(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_RUNTIME_DIR/ckptdrain-<uid>.sock``, else ``/tmp/ckptdrain-<uid>.sock``: the same
    fallback the client uses when neither ``socket_path=`` nor ``$CKPTDRAIN_SOCKET`` is given."""
    env = os.environ if env is None else env
    runtime_dir = env.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(runtime_dir) / f"ckptdrain-{os.getuid()}.sock"


def _state_home(env: Mapping[str, str]) -> Path:
    state = env.get("XDG_STATE_HOME")
    if state:
        return Path(state)
    home = env.get("HOME")
    if home:
        return Path(home) / ".local" / "state"
    try:
        return Path.home() / ".local" / "state"
    except RuntimeError:  # no $HOME and no passwd entry (a container's arbitrary uid)
        raise ConfigError("staging_dir", "the embedded default keeps staging under "
                          "$XDG_STATE_HOME or $HOME, and neither is set nor has this uid a home "
                          "directory: set one of them, or give a config file") from None


def embedded_default(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The config used when no file is given: per-user directories, a ``file://`` destination
    and loopback metrics, so ``ckptdrain serve`` works without root and without a file."""
    env = os.environ if env is None else env
    state = _state_home(env) / "ckptdrain"
    return {
        "socket": str(default_socket_path(env)),
        "staging_dir": str(state / "staging"),
        "destination": {"uri": (state / "destination").as_uri()},
        "metrics": {"listen": "127.0.0.1:9464"},
    }


def load_config(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> Config:
    """Load, merge and validate the config; raises :class:`ConfigError` for every problem.

    ``path`` is the TOML file; without it ``env["CKPTDRAIN_CONFIG"]`` names one; without that
    the embedded default is used. ``env`` (default ``os.environ``) supplies the overrides.
    """
    env = os.environ if env is None else env
    if path is None and env.get("CKPTDRAIN_CONFIG"):
        path = env["CKPTDRAIN_CONFIG"]
    if path is not None:
        data = _read_toml(Path(path))
        origin = f"in {os.fspath(path)}"
    else:
        data = embedded_default(env)
        origin = "in the embedded default"
    sources: dict[str, str] = {}
    for key, (dotted, value) in env_overrides(env).items():
        section, _, name = dotted.partition(".")
        if name:
            target = data.setdefault(section, {})
            if not isinstance(target, dict):
                raise ConfigError(section, f"is a section; write it as [{section}] {origin}")
            target[name] = value
        else:
            data[section] = value
        sources[dotted] = f"set by {key}"
    return _validate(data, sources=sources, default_source=origin)


def with_limits_from(current: Config, other: Config) -> Config:
    """``current`` with ``limits`` (but ``io_threads`` and ``io_timeout_s``) and ``log_level``
    taken from ``other`` (SIGHUP reload: everything else needs a restart, so a reload never
    changes it). Validated again: the merge may break a check across sections."""
    merged = current.model_dump()
    # Except the data plane's size and timeout, fixed when it was built (a restart).
    merged["limits"] = {**other.limits.model_dump(),
                        "io_threads": current.limits.io_threads,
                        "io_timeout_s": current.limits.io_timeout_s}
    merged["log_level"] = other.log_level
    return _validate(merged, sources={})


# Far more than any config: a larger "file" is something else (found attacking: a config
# linked to /dev/zero grew the daemon by gigabytes a second on reload).
MAX_CONFIG_BYTES = 1 << 20


def _read_toml(path: Path) -> dict[str, Any]:
    where = os.fspath(path)
    hint = "pass --config PATH with an existing file, or unset CKPTDRAIN_CONFIG"
    try:
        # Not blocking on a FIFO (its open waited for a writer for ever: found attacking the
        # reload), and only a regular file is read.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                if stat.S_ISDIR(mode):
                    raise IsADirectoryError
                raise ConfigError(where, f"is not a regular file (a FIFO, a device?); {hint}")
            with os.fdopen(os.dup(fd), "rb") as f:
                raw = f.read(MAX_CONFIG_BYTES + 1)
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise ConfigError(where, f"no such config file; {hint}") from None
    except IsADirectoryError:
        raise ConfigError(where, f"is a directory, not a config file; {hint}") from None
    except OSError as exc:
        raise ConfigError(
            where, f"cannot read the config file ({exc.strerror}); fix its permissions"
        ) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(where, f"is larger than {MAX_CONFIG_BYTES >> 20} MiB: no config is; "
                          f"{hint}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            where, f"is not UTF-8 text (byte {exc.start}); save it as UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(where, f"TOML syntax error: {exc}; fix the file") from None
    except RecursionError:  # tomllib recurses per nesting level (found attacking: a traceback)
        raise ConfigError(where, "nests arrays or tables too deeply for a config; fix the "
                          "file") from None


_SECTIONS: dict[str, type[BaseModel]] = {
    "limits": LimitsConfig,
    "destination": DestinationConfig,
    "drain": DrainConfig,
    "retention": RetentionConfig,
    "metrics": MetricsConfig,
    "access": AccessConfig,
}


def env_overrides(env: Mapping[str, str]) -> dict[str, tuple[str, Any]]:
    """``{VARIABLE: (dotted key, typed value)}`` for every ``CKPTDRAIN_*`` override."""
    top_fields = {k: f for k, f in Config.model_fields.items() if k not in _SECTIONS}
    known = sorted(
        [ENV_PREFIX + k.upper() for k in top_fields]
        + [
            f"{ENV_PREFIX}{section.upper()}__{name.upper()}"
            for section, model in _SECTIONS.items()
            for name in model.model_fields
        ]
    )
    found: dict[str, tuple[str, Any]] = {}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in ENV_IGNORED:
            continue
        if var.startswith(ENV_IGNORED_PREFIXES):
            continue
        rest = var[len(ENV_PREFIX) :].lower()
        section, sep, name = rest.partition("__")
        if sep and section in _SECTIONS and name in _SECTIONS[section].model_fields:
            annotation = _SECTIONS[section].model_fields[name].annotation
            found[var] = (f"{section}.{name}", _from_env(env[var], annotation))
        elif not sep and rest in top_fields:
            found[var] = (rest, _from_env(env[var], top_fields[rest].annotation))
        elif not sep and rest not in _SECTIONS:
            # Not config-shaped: the client's own variables (CKPTDRAIN_ATTEMPT, ...) and
            # other tools' share the prefix. Only CKPTDRAIN_<KEY> for a top-level key and
            # CKPTDRAIN_<SECTION>__<KEY> are config; a typo in the latter is still reported.
            continue
        else:
            if not sep:
                reason = f"names a section; set {var}__<KEY> for one of its keys"
            else:
                reason = "is not a ckptdrain setting; remove it or fix the spelling"
                close = difflib.get_close_matches(var, known, n=1)
                if close:
                    reason += f" (did you mean {close[0]}?)"
            raise ConfigError(var, reason)
    return found


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _from_env(text: str, annotation: Any) -> Any:
    """An environment string as the field's type; left a string when it does not parse, so
    validation reports it against the key like any other wrong value."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if text == "":
            return None
        annotation = next(a for a in args if a is not type(None))
        origin = typing.get_origin(annotation)
    if annotation is bool:
        low = text.strip().lower()
        return True if low in _TRUE else False if low in _FALSE else text
    if annotation is int:
        try:
            return int(text)
        except ValueError:
            return text  # sizes like "64MiB" are parsed by the field itself
    if annotation is float:
        try:
            return float(text)
        except ValueError:
            return text
    if origin is list:
        stripped = text.strip()
        if stripped.startswith("["):
            try:
                return json.loads(stripped)
            except (json.JSONDecodeError, RecursionError):
                return text
        items = [item.strip() for item in stripped.split(",") if item.strip()]
        (item_type,) = typing.get_args(annotation) or (str,)
        return [_from_env(item, item_type) for item in items]
    return text


def _validate(
    data: dict[str, Any], *, sources: Mapping[str, str], default_source: str = ""
) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        key = _dotted(first)
        reason = _reason(first, key)
        source = sources.get(key) or sources.get(key.split("[")[0]) or default_source
        if source:
            reason += f" ({source})"
        if len(errors) > 1:
            reason += f"; {len(errors) - 1} more problem(s) after this one"
        raise ConfigError(key, reason) from None


def _dotted(error: Mapping[str, Any]) -> str:
    key = ""
    for part in error["loc"]:
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
    field = (error.get("ctx") or {}).get("field")
    if field:
        key = f"{key}.{field}" if key else str(field)
    return key or "config"


_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "model_type": "a table (a [section])",
    "dict_type": "a table (a [section])",
    "path_type": "a path string",
    "is_instance_of": "a path string",
}


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__


def _reason(error: Mapping[str, Any], key: str) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    value = error.get("input")
    if kind == "extra_forbidden":
        parent, _, name = key.rpartition(".")
        model = _SECTIONS.get(parent, Config if not parent else None)
        reason = "unknown key; remove it or fix the spelling"
        if model is not None:
            close = difflib.get_close_matches(name, list(model.model_fields), n=1)
            if close:
                reason += f" (did you mean {close[0]}?)"
        return reason
    if kind == "value_error":
        message = str(ctx.get("error", error["msg"]))
        return message
    if kind == "cross_field":
        return str(error["msg"])
    if kind in _TYPE_WORDS:
        return f"expected {_TYPE_WORDS[kind]}, got {as_written(value)} ({_type_name(value)})"
    if kind == "literal_error":
        return f"{as_written(value)} is not one of {ctx.get('expected', '')}".replace("'", '"')
    bounds = {
        "greater_than_equal": (">=", "ge"),
        "greater_than": (">", "gt"),
        "less_than_equal": ("<=", "le"),
        "less_than": ("<", "lt"),
    }
    if kind in bounds:
        symbol, ctx_key = bounds[kind]
        limit = ctx.get(ctx_key)
        if key.endswith("_bytes"):
            return f"must be {symbol} {human_bytes(limit)} (got {human_bytes(value)})"
        return f"must be {symbol} {limit} (got {as_written(value)})"
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "finite_number":
        return f"must be a finite number (got {as_written(value)})"
    return f"{as_written(value)} is not valid: {error['msg']}"
