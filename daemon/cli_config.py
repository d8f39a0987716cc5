"""``ckptdrain config check / show``: the configuration a daemon started here would run with.

``check`` loads and validates it (exit 78 naming the key when it is wrong) and says what the
start-up checks would find about the staging disk; ``show`` prints the effective configuration
(file or embedded default, then environment overrides) as TOML a daemon can load, each size
also in human form and each key set by the environment marked with its variable.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptdrain.daemon.cli_destination import EXIT_OK, human


def _load(ns: argparse.Namespace) -> tuple[Any, str, dict[str, str]]:
    """(config, where it came from, {dotted key: environment variable that set it})."""
    from ckptdrain.daemon.configload import env_overrides, load_config

    config = load_config(ns.config)  # ConfigError: exit 78
    path = ns.config or os.environ.get("CKPTDRAIN_CONFIG")
    origin = str(path) if path else "the embedded default (no config file)"
    by_env = {dotted: var for var, (dotted, _) in env_overrides(os.environ).items()}
    return config, origin, by_env


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def cmd_check(ns: argparse.Namespace) -> int:
    from ckptdrain.daemon.errors import ConfigError, StartupError
    from ckptdrain.daemon.startup import socket_group_usable

    config, origin, by_env = _load(ns)
    try:  # the group exists here (whose user runs the daemon, `serve` checks)
        socket_group_usable(config.access.socket_group, member=False)
    except StartupError as exc:
        raise ConfigError(exc.key, exc.reason) from None
    print(f"configuration OK: {origin}"
          + (f", {len(by_env)} key(s) set by the environment ({', '.join(sorted(by_env.values()))})"
             if by_env else ""))
    limit = config.limits.max_staged_bytes
    where = _existing(config.staging_dir)
    try:
        st = os.statvfs(where)
    except OSError as exc:
        print(f"note: cannot inspect the staging filesystem at {where}: {exc.strerror}")
        return EXIT_OK
    size = st.f_blocks * st.f_frsize
    if limit > st.f_bavail * st.f_frsize:
        print(f"note: limits.max_staged_bytes ({human(limit)}) is more than the "
              f"{human(st.f_bavail * st.f_frsize)} free on the staging filesystem ({where}, "
              f"{human(size)}): the daemon will clamp it to the room there at start-up; set it "
              "lower to silence this")
    return EXIT_OK


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)  # strings and lists of them: valid TOML basic strings and arrays


def render_toml(data: dict[str, Any], by_env: dict[str, str]) -> str:
    lines: list[str] = []
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    for prefix, section in [("", {k: v for k, v in data.items() if k not in tables}),
                            *((f"{k}.", v) for k, v in tables.items())]:
        if prefix:
            lines += ["", f"[{prefix[:-1]}]"]
        for key, value in section.items():
            notes = []
            if key.endswith("_bytes") and isinstance(value, int):
                notes.append(human(value))
            var = by_env.get(prefix + key)
            if var:
                notes.append(f"set by {var}")
            if value is None:
                lines.append(f"# {key} is unset" + (f" ({var})" if var else ""))
                continue
            line = f"{key} = {_toml_value(value)}"
            lines.append(line + (f"  # {'; '.join(notes)}" if notes else ""))
    return "\n".join(lines) + "\n"


def cmd_show(ns: argparse.Namespace) -> int:
    config, origin, by_env = _load(ns)
    data = config.redacted_dict()
    if ns.json:
        print(json.dumps({"source": origin, "set_by_environment": by_env, "config": data},
                         indent=2, sort_keys=True))
        return EXIT_OK
    print(f"# the effective ckptdrain configuration: {origin}, then the environment")
    print(render_toml(data, by_env), end="")
    return EXIT_OK


def add_parsers(sub: Any, common: Callable[..., None]) -> None:
    config = sub.add_parser("config", help="check or show the configuration")
    commands = config.add_subparsers(dest="config_command", required=True, metavar="COMMAND")
    p = commands.add_parser("check", help="validate the configuration (exit 78 naming the key when wrong)")
    common(p)
    p.set_defaults(fn=cmd_check)
    p = commands.add_parser("show", help="the effective configuration, with environment overrides")
    common(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_show)
