"""``ckptdrain ls / verify / gc``: the commands that read or prune a destination, and what they
and ``restore`` (cli_restore.py) share: DEST opened as a backend, a command run on it, the
argument types, the generation a ``--generation`` names.

They need no daemon. Each raises :class:`CommandFailed` (or another typed error) for an
expected failure; ``cli.main`` is the one place that turns errors into messages and exit codes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ckptdrain.daemon.cli_stop import stoppable
from ckptdrain.daemon.errors import DaemonError
from ckptdrain.daemon.sizes import human_amount

if TYPE_CHECKING:
    from ckptdrain.client.manifest import Manifest

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CONFIG = 0, 1, 2, 78
T = TypeVar("T")


class CommandFailed(DaemonError):
    """An expected failure of a command: its message is shown as is, with ``code`` (exit 1)."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


human = human_amount


def print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=True))


# -- argument types: a bad value is a usage error (exit 2) with one sentence, never a traceback --
def dest_arg(text: str) -> str:
    from ckptdrain.daemon.uris import split_uri

    if text.startswith("/"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a path, not a destination URI; write file://{text}")
    try:
        split_uri(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def job_arg(text: str) -> str:
    from ckptdrain.client.errors import RejectedInput
    from ckptdrain.client.names import validate_job

    try:
        return validate_job(text)
    except RejectedInput as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def step_arg(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) >= 2**63:
        raise argparse.ArgumentTypeError(f"takes a step number (0 or more), not {text!r}")
    return int(text)


def readers_arg(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) > 64:
        raise argparse.ArgumentTypeError(f"takes a number of processes from 0 to 64, not {text!r}")
    return int(text)


def to_arg(text: str) -> str:
    # An empty --to (an unset variable in a script: --to "$DIR") read as the current
    # directory, and with --overwrite a restore wrote over it (found attacking restore).
    if not text:
        raise argparse.ArgumentTypeError("takes a directory to restore into, not an empty "
                                         "string (an unset variable?); write --to . for the "
                                         "current directory")
    return text


def file_arg(what: str) -> Callable[[str], Path]:
    """A path argument that may not be empty: ``--config ""`` read as the current directory
    ("is a directory, not a config file", exit 78) and ``--socket ""`` as a daemon at "."
    (exit 1), where the mistake is an unset variable in a script (found as a new operator)."""
    def parse(text: str) -> Path:
        if not text:
            raise argparse.ArgumentTypeError(f"takes {what}, not an empty string (an unset "
                                             "variable?); leave the option out for the default")
        return Path(text)
    return parse


def generation_arg(text: str) -> str:
    # Bounded as step_arg is: a step past 2**63 - 1 came out of the manifest code as a
    # traceback (found attacking restore). Zero-padded steps (the generation directories'
    # 20 digits) are steps too; the digits are counted before int() would refuse them.
    digits = text.lstrip("0") or "0"
    if text != "latest" and not (text.isascii() and text.isdigit() and len(digits) <= 19
                                 and int(digits) < 2**63):
        raise argparse.ArgumentTypeError(f"takes a step number (0 to {2**63 - 1}) or "
                                         f"'latest', not {text!r}")
    return text if text == "latest" else digits  # (int() refuses 4,300 digits and more)


# -- the destination ------------------------------------------------------------------------------
def _backend(ns: argparse.Namespace, dest: str) -> Any:
    from ckptdrain.daemon.uris import split_uri

    node = os.uname().nodename.replace("/", "_")
    scheme, location, _ = split_uri(dest)  # checked by dest_arg already
    if scheme == "file":
        # A typo'd path must not read as an empty destination ("no generations", exit 0).
        if not Path(location).is_dir():
            raise CommandFailed(f"destination {dest} does not exist (no directory "
                                f"{location}); check DEST")
        if ns.command in ("ls", "verify", "restore") and not _configuration_named(ns):
            # Nothing configurable changes how a directory is read: with no configuration
            # named (as for the socket, cli_node.socket_path), none is loaded. A restore from
            # Lustre then starts in a third of the time and works while the config is broken.
            from ckptdrain.daemon.backends.posix import PosixBackend, ReadSettings

            return PosixBackend(ReadSettings(dest, Path(location)), node)
    from ckptdrain.daemon.backends import open_backend
    from ckptdrain.daemon.config import DestinationConfig
    from ckptdrain.daemon.configload import load_config

    base = load_config(ns.config).destination  # ConfigError: exit 78
    try:
        destination = DestinationConfig.model_validate({**base.model_dump(), "uri": dest})
    except ValueError as exc:
        raise CommandFailed(f"bad destination {dest!r}: {exc}", EXIT_USAGE) from None
    # This process's loop serves the command alone: a restore writes on it (open_backend).
    return open_backend(destination, node, writes_on_loop=True, readers=_readers(ns))


def _configuration_named(ns: argparse.Namespace) -> bool:
    """Whether the operator named a configuration: a file (``--config``, ``$CKPTDRAIN_CONFIG``)
    or a section key in the environment (``CKPTDRAIN_<SECTION>__<KEY>``, whose misspelling
    is an error to report). Top-level names (``CKPTDRAIN_SOCKET``, set for training clients)
    change nothing a destination command does."""
    return bool(ns.config or os.environ.get("CKPTDRAIN_CONFIG") or any(
        name.startswith("CKPTDRAIN_") and "__" in name and not name.startswith("CKPTDRAIN_TEST_")
        for name in os.environ))


def _readers(ns: argparse.Namespace) -> int:
    """``restore --readers``, with -1 resolved: a quarter of the cores, at most 8, and none
    below two. One process's event loop reads about 1 GB/s from S3 at most; each reader costs
    about 0.3 CPU s to start and splits the stream into smaller reads, so on a machine of a
    few cores (where the S3 server or the network is the bound) it only adds CPU."""
    readers = int(getattr(ns, "readers", 0))
    if readers >= 0:
        return readers
    quarter = min(8, len(os.sched_getaffinity(0)) // 4)  # the cores this process may use
    return quarter if quarter >= 2 else 0


async def _with_backend(ns: argparse.Namespace, dest: str,
                        fn: Callable[[Any], Coroutine[Any, Any, T]]) -> T:
    from ckptdrain.daemon.backends import BackendError

    backend = _backend(ns, dest)
    try:
        return await fn(backend)
    except BackendError as exc:
        raise CommandFailed(f"{dest}: {exc}") from None
    finally:
        await backend.aclose()


def run_on(ns: argparse.Namespace, fn: Callable[[Any], Coroutine[Any, Any, T]]) -> T:
    # uvloop, as the daemon: restore's many concurrent ranged GETs cost less CPU per byte.
    # A signal stops it once it has cleaned up behind it (cli_stop.py).
    main = stoppable(_with_backend(ns, ns.dest, fn))
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(main)
    return uvloop.run(main)


# -- ls, gc: what DEST and --job name ------------------------------------------------------------
async def _refuse_a_job_directory(backend: Any, ns: argparse.Namespace) -> None:
    """Refuse a DEST that is a job's directory (one level too deep): it holds a LATEST file,
    or a generation directory (20 digits) with a MANIFEST.json or a ``_parts/`` in it (a job
    may itself be named with 20 digits). Found attacking the CLI: `ls` and `gc` of one exited
    0 saying nothing, as for an empty destination."""
    from ckptdrain.client.keys import LATEST_NAME, parse_generation_dir
    from ckptdrain.client.names import MANIFEST_NAME

    holds = ""
    if await backend.stat(LATEST_NAME, checksum=False) is not None:
        holds = f"a {LATEST_NAME} file"
    else:
        steps = [name for name in await backend.list_dirs("") if parse_generation_dir(name) is not None]
        for step in steps[:-3:-1]:  # the newest two: the newest may be one in flight
            if (await backend.stat(f"{step}/{MANIFEST_NAME}", checksum=False) is not None
                    or "_parts" in await backend.list_dirs(f"{step}/")):
                holds = f"generation directories ({step})"
                break
    if holds:
        parent, _, name = ns.dest.rstrip("/").rpartition("/")
        raise CommandFailed(f"{ns.dest} is a job's directory, not a destination: it holds {holds} "
                            f"at its top; give its parent as DEST and the job with --job: "
                            f"`ckptdrain {ns.command} {parent} --job {name}`")


async def _refuse_an_unknown_job(backend: Any, job: str) -> None:
    """Refuse a --job with nothing of it at the destination (no generation directory, no
    LATEST), as restore and verify refuse one with no committed generation: a typo'd name
    must not read as a job with nothing to list or remove (found attacking: `gc --job jl`
    exited 0)."""
    from ckptdrain.client.keys import latest_key

    if not await backend.list_dirs(f"{job}/") and await backend.stat(
            latest_key(job), checksum=False) is None:
        raise CommandFailed(f"no job {job!r} at {backend.uri}: nothing of it is there; check "
                            f"the job name with `ckptdrain ls {backend.uri}`")


# -- ls ---------------------------------------------------------------------------------------
def cmd_ls(ns: argparse.Namespace) -> int:
    from ckptdrain.daemon import catalog

    async def run(backend: Any) -> list[dict[str, Any]]:
        await _refuse_a_job_directory(backend, ns)
        jobs = [ns.job] if ns.job else await catalog.list_jobs(backend)
        rows = []
        for job in jobs:
            for info in await catalog.list_generations(backend, job):
                rows.append({
                    "job": info.job, "generation": info.step, "shards": info.shards,
                    "bytes": info.bytes, "committed_at": info.committed_at, "nodes": list(info.nodes),
                })
        if ns.job and not rows:
            await _refuse_an_unknown_job(backend, ns.job)
        return rows

    rows = run_on(ns, run)
    if ns.json:
        print_json(rows)
        return EXIT_OK
    if not rows:
        print(f"no committed generations at {ns.dest}" + (f" for job {ns.job}" if ns.job else ""))
        return EXIT_OK
    # As wide as what they hold (a job name takes up to 128 characters, a step 19 digits: a
    # long one pushed the row out of line), and the time with its zone: a bare local time
    # read differently on nodes and laptops set to other zones (found as a new operator).
    jw = max(20, *(len(r["job"]) for r in rows))
    gw = max(12, *(len(str(r["generation"])) for r in rows))
    print(f"{'JOB':<{jw}} {'GENERATION':>{gw}} {'SHARDS':>7} {'BYTES':>11}  COMMITTED")
    for r in rows:
        when = (time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(r["committed_at"]))
                if r["committed_at"] else "-")
        print(f"{r['job']:<{jw}} {r['generation']:>{gw}} {r['shards']:>7} "
              f"{human(r['bytes']):>11}  {when}")
    return EXIT_OK


async def resolve_generation(backend: Any, job: str, generation: str) -> Manifest:
    """The manifest ``--generation`` names (a step, or ``latest``), read once: the command
    goes on with it, never with a step whose manifest it reads again (retention removing
    "latest" between the two reads, once a newer step committed, failed `restore` and
    `verify` with "generation 30 is not committed"). NotCommitted when there is none."""
    from ckptdrain.daemon import catalog

    return await catalog.resolve(backend, job,
                                 "latest" if generation == "latest" else int(generation))


# -- verify -----------------------------------------------------------------------------------
def cmd_verify(ns: argparse.Namespace) -> int:
    from ckptdrain.daemon import catalog

    async def run(backend: Any) -> tuple[int, Any]:
        manifest = await resolve_generation(backend, ns.job, ns.generation)
        return manifest.generation, await catalog.verify(backend, ns.job, manifest,
                                                         read=ns.read)

    step, report = run_on(ns, run)
    if ns.json:
        print_json({"job": ns.job, "generation": step, "ok": report.ok, "checked": report.checked,
                    "bytes": report.bytes, "stored": report.stored,
                    "bad": [{"path": path, "reason": why} for path, why in report.bad]})
    if not report.ok:
        if not ns.json:
            for path, reason in report.bad:
                print(f"BAD {path}: {reason}", file=sys.stderr)
        first = report.bad[0] if report.bad else ("?", "unknown")
        raise CommandFailed(
            f"generation {step} of job {ns.job!r} failed verification: {len(report.bad)} bad shard(s), "
            f"first {first[0]!r} ({first[1]}); run verify again (bytes damaged on the way "
            "read right a second time), and if it fails the same way restore an older generation"
        )
    if not ns.json:
        how = (f" ({report.stored} by the checksum the destination stored; --read re-reads "
               "them)" if report.stored else "")
        print(f"generation {step} of job {ns.job!r}: {report.checked} shards, "
              f"{human(report.bytes)} read, all checksums match{how}")
    return EXIT_OK


# -- gc ---------------------------------------------------------------------------------------
def cmd_gc(ns: argparse.Namespace) -> int:
    from ckptdrain.daemon import retention
    from ckptdrain.daemon.configload import load_config

    policy = load_config(ns.config).retention
    keep_last = policy.keep_last if ns.keep_last is None else ns.keep_last
    grace_s = policy.abandoned_grace_s if ns.grace_s is None else ns.grace_s
    if keep_last < 1:
        raise CommandFailed(f"--keep-last must be at least 1 (the newest committed generation is "
                            f"always kept), not {keep_last}", EXIT_USAGE)
    if not 0 <= grace_s < float("inf"):
        raise CommandFailed(f"--grace-s must be a finite number of seconds >= 0, not {grace_s}",
                            EXIT_USAGE)

    async def run(backend: Any) -> list[Any]:
        await _refuse_a_job_directory(backend, ns)
        if ns.job:
            await _refuse_an_unknown_job(backend, ns.job)
        jobs = [ns.job] if ns.job else None
        return await retention.gc(backend, jobs, keep_last, grace_s, ns.dry_run)

    reports = run_on(ns, run)
    if ns.json:
        print_json([{
            "job": r.job, "dry_run": r.dry_run, "keep_last": keep_last, "abandoned_grace_s": grace_s,
            "kept": r.kept, "deleted": r.deleted, "abandoned_deleted": r.abandoned_deleted,
            "skipped": [{"generation": s, "reason": why} for s, why in r.skipped],
            "failed": [{"generation": s, "reason": why} for s, why in r.failed],
        } for r in reports])
    elif not reports:
        print(f"no committed generations at {ns.dest}; nothing to do")
    else:
        verb = "would delete" if ns.dry_run else "deleted"
        for r in reports:
            print(f"job {r.job}: kept {_steps(r.kept)}; {verb} {_steps(r.deleted)}; "
                  f"{verb} abandoned {_steps(r.abandoned_deleted)}")
            for step, why in r.skipped:
                print(f"    left {step}: {why}")
            for step, why in r.failed:
                print(f"    FAILED {step}: {why}", file=sys.stderr)
    failed = [(r.job, step, why) for r in reports for step, why in r.failed]
    if failed:
        job, step, why = failed[0]
        raise CommandFailed(f"{len(failed)} generation(s) could not be removed, first {job!r} {step}: {why}")
    return EXIT_OK


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"


def add_parsers(sub: Any, common: Callable[..., None]) -> None:
    p = sub.add_parser("ls", help="committed generations at a destination")
    common(p)
    p.add_argument("dest", metavar="DEST", type=dest_arg, help="file:///path or s3://bucket/prefix")
    p.add_argument("--job", type=job_arg, help="only this job (default: every job)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_ls)

    # Imported here, not at the top: cli_restore imports this module's helpers.
    from ckptdrain.daemon.cli_restore import cmd_restore

    for name, fn, text in (("verify", cmd_verify, "check every shard against its checksum"),
                           ("restore", cmd_restore, "copy a committed generation to a directory")):
        p = sub.add_parser(name, help=text)
        common(p)
        p.add_argument("dest", metavar="DEST", type=dest_arg,
                       help="file:///path or s3://bucket/prefix")
        p.add_argument("--job", required=True, type=job_arg, help="the training job's name")
        p.add_argument("--generation", default="latest", type=generation_arg,
                       help="a step number or 'latest' (default)")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "verify":
            p.add_argument("--read", action="store_true",
                           help="re-read every byte, also where the destination stores and "
                                "validated each shard's checksum (S3)")
        if name == "restore":
            p.add_argument("--to", required=True, type=to_arg, help="directory to restore into (new or empty)")
            p.add_argument("--overwrite", action="store_true",
                           help="restore into a non-empty directory, replacing files of the same name")
            p.add_argument("--progress", action="store_true", help="show the progress bar even when not on a terminal")
            p.add_argument("--quiet", action="store_true",
                           help="no progress bar, even on a terminal (--progress wins)")
            p.add_argument("--socket", type=file_arg("a socket path"), help="this node's daemon, for the local fast path")
            p.add_argument("--no-local", action="store_true",
                           help="read everything from DEST, not from this node's local copies")
            p.add_argument("--readers", type=readers_arg, default=-1, metavar="N",
                           help="processes that read S3 objects of 256 MiB or more, in ranges "
                                "(default: a quarter of the cores, at most 8, none below 2; "
                                "0: this process alone)")
        p.set_defaults(fn=fn)

    p = sub.add_parser("gc", help="apply retention: delete old and abandoned generations at a destination")
    common(p)
    p.add_argument("dest", metavar="DEST", type=dest_arg, help="file:///path or s3://bucket/prefix")
    p.add_argument("--job", type=job_arg, help="only this job (default: every job with a committed generation)")
    p.add_argument("--keep-last", type=int, metavar="N", help="committed generations kept per job (default: retention.keep_last)")
    p.add_argument("--grace-s", type=float, metavar="S", help="age after which an uncommitted generation older than the newest committed one is removed (default: retention.abandoned_grace_s)")
    p.add_argument("--dry-run", action="store_true", help="say what would be deleted; delete nothing")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_gc)
