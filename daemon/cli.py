"""``ckptdrain``: the command line. The only place that maps errors to exit codes.

Exit codes: 0 ok, 1 the operation failed, 2 usage, 75 a disk the daemon must write to start
is full for now (EX_TEMPFAIL: ``Restart=on-failure`` retries it), 78 configuration or
environment (EX_CONFIG: a bad config, an unwritable path, a port in use, a lock held). An
expected failure prints one sentence naming the cause and the fix, never a traceback. The
commands live in :mod:`.cli_node` (the daemon on this node), :mod:`.cli_destination` and
:mod:`.cli_restore` (a destination).
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

# Before the imports below (0.1-0.3 s): a SIGHUP in that time ended `serve` by its default
# action (found attacking the reload; cli_node.cmd_serve says why it is ignored). Only for
# `serve`: the other commands keep what they inherit (`nohup ckptdrain restore` stays so).
if sys.argv[1:2] == ["serve"]:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

from ckptdrain.client import DrainError
from ckptdrain.daemon import __version__
from ckptdrain.daemon.cli_destination import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CommandFailed,
    file_arg,
)
from ckptdrain.daemon.cli_stop import Stopped
from ckptdrain.daemon.errors import (
    ConfigError,
    DaemonError,
    DiskFull,
    OperatorNeeded,
    StartupError,
    one_line,
)

__all__ = ["EXIT_CONFIG", "EXIT_FAILED", "EXIT_OK", "EXIT_TEMPFAIL", "EXIT_USAGE",
           "CommandFailed", "main"]

# sysexits' EX_TEMPFAIL: systemd restarts the unit after it (Restart=on-failure prevents only 78).
EXIT_TEMPFAIL = 75


def _fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    # One line whatever the message carries: an S3 server's error message with a newline in
    # it made two (found attacking the destination commands).
    print(f"ckptdrain: {one_line(message)}", file=sys.stderr)
    raise SystemExit(code)


class _Parser(argparse.ArgumentParser):
    """A usage mistake is one line naming the argument and pointing at --help, exit 2."""

    def error(self, message: str) -> NoReturn:
        # "status: ..." for a subcommand's; the top level's is said once ("ckptdrain:
        # ckptdrain: ..." before: found attacking).
        where = self.prog.removeprefix("ckptdrain").strip()
        _fail(f"{where + ': ' if where else ''}{message}; see `{self.prog} --help`", EXIT_USAGE)


def cmd_plan(ns: argparse.Namespace) -> int:
    from ckptdrain.daemon.plan import (
        PlanError,
        compute_plan,
        plan_from_args,
        render_plan,
        render_plan_json,
    )

    try:
        inp = plan_from_args(ns)
        plan = compute_plan(inp)
    except PlanError as exc:
        raise CommandFailed(str(exc), EXIT_USAGE) from None
    print(render_plan_json(plan, inp) if ns.json else render_plan(plan, inp))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from ckptdrain.daemon import cli_config, cli_destination, cli_node
    from ckptdrain.daemon.plan import add_plan_arguments

    parser = _Parser(prog="ckptdrain", description="Checkpoint drain daemon and tools.")
    parser.add_argument("--version", action="version", version=f"ckptdrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=_Parser)

    def common(p: argparse.ArgumentParser, *, socket: bool = False) -> None:
        p.add_argument("--config", type=file_arg("a config file"), help="TOML config (default: $CKPTDRAIN_CONFIG or the embedded default)")
        if socket:
            p.add_argument("--socket", type=file_arg("a socket path"), help="daemon socket (default: $CKPTDRAIN_SOCKET, /run/ckptdrain.sock or the per-user default)")

    cli_node.add_parsers(sub, common)
    cli_destination.add_parsers(sub, common)
    cli_config.add_parsers(sub, common)

    p = sub.add_parser("plan", help="the checkpoint sizing worksheet")
    add_plan_arguments(p)
    p.set_defaults(fn=cmd_plan)
    return parser


def _quiet_broken_pipe() -> None:
    # The reader went away (`ckptdrain status | head -2`): what it did not read is not wanted.
    # Point stdout at /dev/null so the interpreter's final flush does not complain again.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _os_message(exc: OSError) -> str:
    where = f"{exc.filename}: " if exc.filename else ""
    what = exc.strerror or str(exc) or type(exc).__name__
    name = errno.errorcode.get(exc.errno or 0, "")
    fix = {
        "EACCES": "run as a user who may use it, or choose another path",
        "EPERM": "run as a user who may use it, or choose another path",
        "ENOSPC": "free space there and try again",
        "EROFS": "choose a writable path",
        "ENOENT": "check the path",
    }
    return f"{where}{what}; {fix.get(name, 'fix the cause and try again')}"


# What `pip install 'ckptdrain[daemon]'` adds to the stdlib-only client (pyproject.toml).
DAEMON_DEPENDENCIES = ("pydantic", "aiobotocore", "prometheus_client", "aiofiles")
# Commands that need nothing beyond the standard library.
STDLIB_COMMANDS = frozenset({"plan"})


def missing_daemon_dependencies() -> list[str]:
    return [name for name in DAEMON_DEPENDENCIES if importlib.util.find_spec(name) is None]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        ns = build_parser().parse_args(argv)
        missing = [] if ns.command in STDLIB_COMMANDS else missing_daemon_dependencies()
        if missing:
            _fail(f"`ckptdrain {ns.command}` needs the daemon's dependencies, and "
                  f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed "
                  "here (`pip install ckptdrain` is the client only); install them with "
                  "`pip install 'ckptdrain[daemon]'`, or install the ckptdrain Debian package",
                  EXIT_CONFIG)
        return _run(ns)
    except BrokenPipeError:
        _quiet_broken_pipe()
        return EXIT_OK
    except KeyboardInterrupt:  # before the command's event loop runs (cli_stop.py after)
        _fail("interrupted", 130)


def _run(ns: argparse.Namespace) -> int:
    try:
        code = int(ns.fn(ns))
        sys.stdout.flush()
        return code
    except ConfigError as exc:
        _fail(f"bad configuration: {exc}", EXIT_CONFIG)
    except DiskFull as exc:  # a StartupError, but one a later start gets past
        _fail(f"cannot start: {exc} (exit 75, a temporary failure: systemd's "
              "Restart=on-failure retries it)", EXIT_TEMPFAIL)
    except StartupError as exc:
        _fail(f"cannot start: {exc}", EXIT_CONFIG)
    except OperatorNeeded as exc:
        _fail(f"cannot start: {exc}", EXIT_CONFIG)
    except CommandFailed as exc:
        _fail(str(exc), exc.code)
    except Stopped as exc:
        _fail(str(exc), exc.code)
    except DrainError as exc:
        _fail(exc.message)
    except DaemonError as exc:
        _fail(str(exc))
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):
            raise
        _fail(_os_message(exc))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
