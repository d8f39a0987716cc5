"""``ckptdrain``: the command line. The only place that maps errors to exit codes.

Exit codes: 0 ok, 1 the operation failed, 2 usage, 78 bad configuration (EX_CONFIG).
An expected failure prints one sentence naming the cause and the fix, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from ckptdrain.client import Client, DrainError
from ckptdrain.client.client import default_socket_path
from ckptdrain.daemon import __version__
from ckptdrain.daemon.errors import DaemonError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CONFIG = 0, 1, 2, 78
T = TypeVar("T")


class CommandFailed(DaemonError):
    """An expected failure of a command: its message is shown as is, exit 1."""


def _fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    print(f"ckptdrain: {message}", file=sys.stderr)
    raise SystemExit(code)


def _load_config(ns: argparse.Namespace) -> Any:
    from ckptdrain.daemon.config import ConfigError, load_config

    try:
        return load_config(getattr(ns, "config", None))
    except ConfigError as exc:
        _fail(f"bad configuration: {exc}", EXIT_CONFIG)


def _socket_path(ns: argparse.Namespace) -> str:
    if ns.socket:
        return str(ns.socket)
    if ns.config or os.environ.get("CKPTDRAIN_CONFIG"):
        return str(_load_config(ns).socket)
    return default_socket_path()


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# -- serve ------------------------------------------------------------------------------------
def cmd_serve(ns: argparse.Namespace) -> int:
    from ckptdrain.daemon.logs import setup_logging
    from ckptdrain.daemon.server import Daemon
    from ckptdrain.daemon.systemd import SocketActivationError, listen_fds

    config = _load_config(ns)
    setup_logging(config.log_level)
    try:
        inherited = listen_fds()
    except SocketActivationError as exc:
        _fail(f"{exc}")
    try:
        import uvloop

        runner: Callable[[Coroutine[Any, Any, None]], None] = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency; stay usable without it
        runner = asyncio.run
    daemon = Daemon(config, inherited=inherited[0] if inherited else None,
                    config_path=str(ns.config) if ns.config else None)
    ran = threading.Event()
    # Once the daemon has stopped (journal flushed), a thread stuck in a blocking call (a
    # client fd on a hung mount) must not hold the process past the unit's stop timeout: the
    # interpreter would wait for it forever, in the event loop's shutdown or at exit.
    daemon.on_stopped = lambda: threading.Thread(target=_exit_if_stuck, args=(ran,),
                                                 daemon=True).start()
    from ckptdrain.daemon.journal import JournalError

    try:
        runner(daemon.run())
    except JournalError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot serve: {exc}")
    ran.set()
    _flush_and_exit(EXIT_OK)
    return EXIT_OK


STOPPED_EXIT_GRACE_S = 10.0


def _exit_if_stuck(ran: threading.Event) -> None:
    if not ran.wait(STOPPED_EXIT_GRACE_S):
        logging.getLogger("ckptdrain.cli").warning(
            "event=exit_with_stuck_threads action=\"threads stuck in blocking calls are left to "
            "the kernel\"")
        _flush_and_exit(EXIT_OK)


def _flush_and_exit(code: int) -> None:
    """Exit without joining worker threads: everything durable was written before "stopped"."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# -- status -----------------------------------------------------------------------------------
def cmd_status(ns: argparse.Namespace) -> int:
    with Client(_socket_path(ns), timeout_s=30) as client:
        status = client.status()
    if ns.json:
        print(json.dumps(status, indent=2, sort_keys=True))
        return EXIT_OK
    limits = status["limits"]
    print(f"node {status['node_id']}  ack={status['ack']}  destination {status['destination']}")
    print(
        f"staged {_human(status['staged_bytes'])} of {_human(limits['max_staged_bytes'])}"
        f"  queued shards {status['queued_shards']}/{limits['max_queued_shards']}"
        f"  drain {_human(status['drain_rate_bytes_per_s'])}/s"
        f"  blocked hand-offs {status['blocked_handoffs']}"
        + "".join(f" ({n} on {limit})" for limit, n in status.get("blocked_by_limit", {}).items())
    )
    gens = status["generations"]
    if not gens:
        print("no generations on this node")
        return EXIT_OK
    header = f"{'JOB':<20} {'STEP':>10} {'STATE':<10} {'RANKS':>5} {'STAGED':>7} {'DRAINED':>7} {'BYTES':>11} {'OLDEST':>8}"
    print(header)
    for g in gens:
        shards = g["shards"]
        undrained = sum(shards.get(s, 0) for s in ("staged", "draining", "failed"))
        total_bytes = sum(g["bytes"].values())
        print(
            f"{g['job']:<20} {g['step']:>10} {g['state']:<10} {len(g['ranks']):>5}"
            f" {undrained:>7} {shards.get('drained', 0):>7} {_human(total_bytes):>11}"
            f" {g['oldest_undrained_age_s']:>7.1f}s"
        )
        if g.get("error"):
            print(f"    error: {g['error']}")
    return EXIT_OK


# -- destination commands -----------------------------------------------------------------------
def _backend(ns: argparse.Namespace, dest: str) -> Any:
    from ckptdrain.daemon.backends import open_backend
    from ckptdrain.daemon.config import ConfigError, DestinationConfig, load_config

    try:
        base = load_config(ns.config).destination
        destination = DestinationConfig.model_validate({**base.model_dump(), "uri": dest})
    except ConfigError as exc:
        _fail(f"bad configuration: {exc}", EXIT_CONFIG)
    except ValueError as exc:
        _fail(f"bad destination {dest!r}: {exc}", EXIT_USAGE)
    node = os.uname().nodename.replace("/", "_")
    return open_backend(destination, node)


async def _with_backend(ns: argparse.Namespace, dest: str, fn: Callable[[Any], Coroutine[Any, Any, T]]) -> T:
    from ckptdrain.daemon.backends import BackendError

    backend = _backend(ns, dest)
    try:
        return await fn(backend)
    except BackendError as exc:
        raise CommandFailed(f"{dest}: {exc}") from None
    finally:
        await backend.aclose()


def cmd_ls(ns: argparse.Namespace) -> int:
    from ckptdrain.daemon import catalog

    async def run(backend: Any) -> list[dict[str, Any]]:
        jobs = [ns.job] if ns.job else await catalog.list_jobs(backend)
        rows = []
        for job in jobs:
            for info in await catalog.list_generations(backend, job):
                rows.append({
                    "job": info.job, "generation": info.step, "shards": info.shards,
                    "bytes": info.bytes, "committed_at": info.committed_at, "nodes": list(info.nodes),
                })
        return rows

    rows = _run(_with_backend(ns, ns.dest, run))
    if ns.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    if not rows:
        print(f"no committed generations at {ns.dest}" + (f" for job {ns.job}" if ns.job else ""))
        return EXIT_OK
    print(f"{'JOB':<20} {'GENERATION':>12} {'SHARDS':>7} {'BYTES':>11}  COMMITTED")
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["committed_at"])) if r["committed_at"] else "-"
        print(f"{r['job']:<20} {r['generation']:>12} {r['shards']:>7} {_human(r['bytes']):>11}  {when}")
    return EXIT_OK


async def _resolve_generation(backend: Any, job: str, generation: str) -> int:
    from ckptdrain.daemon import catalog

    if generation == "latest":
        step = await catalog.latest(backend, job)
        if step is None:
            raise CommandFailed(f"job {job!r} has no committed generation at this destination")
        return int(step)
    try:
        return int(generation)
    except ValueError:
        raise CommandFailed(f"--generation takes a number or 'latest', not {generation!r}") from None


def cmd_verify(ns: argparse.Namespace) -> int:
    from ckptdrain.daemon import catalog

    async def run(backend: Any) -> tuple[int, Any]:
        step = await _resolve_generation(backend, ns.job, ns.generation)
        return step, await catalog.verify(backend, ns.job, step)

    step, report = _run(_with_backend(ns, ns.dest, run))
    if not report.ok:
        for path, reason in report.bad:
            print(f"BAD {path}: {reason}", file=sys.stderr)
        first = report.bad[0] if report.bad else ("?", "unknown")
        raise CommandFailed(
            f"generation {step} of job {ns.job!r} failed verification: {len(report.bad)} bad shard(s), "
            f"first {first[0]!r} ({first[1]}); restore an older generation"
        )
    print(f"generation {step} of job {ns.job!r}: {report.checked} shards, {_human(report.bytes)}, all checksums match")
    return EXIT_OK


def cmd_restore(ns: argparse.Namespace) -> int:
    from ckptdrain.daemon import catalog

    async def run(backend: Any) -> tuple[int, Any]:
        step = await _resolve_generation(backend, ns.job, ns.generation)
        manifest = await backend.get_bytes(f"{ns.job}/{step:020d}/MANIFEST.json")
        total = 0
        if manifest:
            from ckptdrain.client.manifest import Manifest

            total = Manifest.from_json(manifest).total_bytes
        bar = ProgressBar(total, enabled=(not ns.quiet and sys.stderr.isatty()) or ns.progress)
        try:
            report = await catalog.restore(backend, ns.job, step, Path(ns.to), progress=bar.advance,
                                           local=None if ns.no_local else _local_source(ns, step))
        finally:
            bar.close()
        return step, report

    step, report = _run(_with_backend(ns, ns.dest, run))
    local = ""
    if report.local_files or report.local_rejected:
        local = f" ({report.local_files} from this node's local copy"
        local += f", {report.local_rejected} local copies failed their checksum and came from {ns.dest})" if report.local_rejected else ")"
    print(f"restored generation {step} of job {ns.job!r} to {ns.to}: {report.files} files, "
          f"{_human(report.bytes)}, checksums verified{local}")
    return EXIT_OK


def _local_source(ns: argparse.Namespace, step: int) -> Any:
    """Restore's fast path: when this node's daemon drains to the same destination, it copies
    the shards it still holds locally (checked against the manifest's checksums)."""
    from ckptdrain.client import NotFound

    try:
        client = Client(_socket_path(ns), timeout_s=600, connect_timeout_s=2)
        if client.status()["destination"].rstrip("/") != ns.dest.rstrip("/"):
            return None
    except DrainError:
        return None  # no daemon here, or not ours: the destination has everything

    async def fetch(shard: Any, fd: int) -> str | None:
        try:
            reply = await asyncio.to_thread(client.fetch_local, ns.job, step, shard.path, fd)
        except NotFound:
            return None
        return str(reply["checksum"])

    return fetch


def cmd_gc(ns: argparse.Namespace) -> int:
    from ckptdrain.daemon import retention

    policy = _load_config(ns).retention
    keep_last = policy.keep_last if ns.keep_last is None else ns.keep_last
    grace_s = policy.abandoned_grace_s if ns.grace_s is None else ns.grace_s
    if keep_last < 1:
        _fail(f"--keep-last must be at least 1 (the newest committed generation is always kept), not {keep_last}", EXIT_USAGE)
    if not 0 <= grace_s < float("inf"):
        _fail(f"--grace-s must be a finite number of seconds >= 0, not {grace_s}", EXIT_USAGE)
    if ns.job:
        from ckptdrain.client.errors import RejectedInput
        from ckptdrain.client.names import validate_job

        try:
            validate_job(ns.job)
        except RejectedInput as exc:
            _fail(f"--job: {exc.message}", EXIT_USAGE)

    async def run(backend: Any) -> list[Any]:
        jobs = [ns.job] if ns.job else None
        return await retention.gc(backend, jobs, keep_last, grace_s, ns.dry_run)

    reports = _run(_with_backend(ns, ns.dest, run))
    if ns.json:
        print(json.dumps([{
            "job": r.job, "dry_run": r.dry_run, "keep_last": keep_last, "abandoned_grace_s": grace_s,
            "kept": r.kept, "deleted": r.deleted, "abandoned_deleted": r.abandoned_deleted,
            "skipped": [{"generation": s, "reason": why} for s, why in r.skipped],
            "failed": [{"generation": s, "reason": why} for s, why in r.failed],
        } for r in reports], indent=2))
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


class ProgressBar:
    """A one-line progress bar on stderr (only on a terminal unless asked for)."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.started = time.monotonic()
        self._last = 0.0

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.2 or self.done >= self.total):
            self._last = now
            frac = self.done / self.total if self.total else 1.0
            rate = self.done / max(now - self.started, 1e-6)
            bar = "#" * int(frac * 30)
            print(f"\r[{bar:<30}] {frac:6.1%} {_human(self.done)} {_human(rate)}/s", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr)


def cmd_retry(ns: argparse.Namespace) -> int:
    with Client(_socket_path(ns), timeout_s=30) as client:
        result = client.retry(ns.job, ns.step)
    print(f"step {ns.step} of job {ns.job!r}: {result.get('requeued', 0)} shard(s) requeued for draining")
    return EXIT_OK


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
        _fail(str(exc), EXIT_USAGE)
    print(render_plan_json(plan, inp) if ns.json else render_plan(plan, inp))
    return EXIT_OK


# -- parser -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from ckptdrain.daemon.plan import add_plan_arguments

    parser = argparse.ArgumentParser(prog="ckptdrain", description="Checkpoint drain daemon and tools.")
    parser.add_argument("--version", action="version", version=f"ckptdrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser, *, socket: bool = False) -> None:
        p.add_argument("--config", type=Path, help="TOML config (default: $CKPTDRAIN_CONFIG or the embedded default)")
        if socket:
            p.add_argument("--socket", type=Path, help="daemon socket (default: $CKPTDRAIN_SOCKET, /run/ckptdrain.sock or the per-user default)")

    p = sub.add_parser("serve", help="run the daemon in the foreground")
    common(p)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("status", help="what the node's daemon holds and how far it has drained")
    common(p, socket=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("ls", help="committed generations at a destination")
    common(p)
    p.add_argument("dest", metavar="DEST", help="file:///path or s3://bucket/prefix")
    p.add_argument("--job")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_ls)

    for name, fn, text in (("verify", cmd_verify, "re-read every shard and check its checksum"),
                           ("restore", cmd_restore, "copy a committed generation to a directory")):
        p = sub.add_parser(name, help=text)
        common(p)
        p.add_argument("dest", metavar="DEST")
        p.add_argument("--job", required=True)
        p.add_argument("--generation", default="latest", help="a step number or 'latest' (default)")
        if name == "restore":
            p.add_argument("--to", required=True, help="directory to restore into")
            p.add_argument("--progress", action="store_true", help="show the progress bar even when not on a terminal")
            p.add_argument("--quiet", action="store_true")
            p.add_argument("--socket", type=Path, help="this node's daemon, for the local fast path")
            p.add_argument("--no-local", action="store_true",
                           help="read everything from DEST, not from this node's local copies")
        p.set_defaults(fn=fn)

    p = sub.add_parser("gc", help="apply retention: delete old and abandoned generations at a destination")
    common(p)
    p.add_argument("dest", metavar="DEST", help="file:///path or s3://bucket/prefix")
    p.add_argument("--job", help="only this job (default: every job with a committed generation)")
    p.add_argument("--keep-last", type=int, metavar="N", help="committed generations kept per job (default: retention.keep_last)")
    p.add_argument("--grace-s", type=float, metavar="S", help="age after which an uncommitted generation older than the newest committed one is removed (default: retention.abandoned_grace_s)")
    p.add_argument("--dry-run", action="store_true", help="say what would be deleted; delete nothing")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_gc)

    p = sub.add_parser("retry", help="drain a failed generation again from its local copy")
    common(p, socket=True)
    p.add_argument("job")
    p.add_argument("step", type=int)
    p.set_defaults(fn=cmd_retry)

    p = sub.add_parser("plan", help="the checkpoint sizing worksheet")
    add_plan_arguments(p)
    p.set_defaults(fn=cmd_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return int(ns.fn(ns))
    except CommandFailed as exc:
        _fail(str(exc))
    except DrainError as exc:
        _fail(exc.message)
    except KeyboardInterrupt:
        _fail("interrupted", 130)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
