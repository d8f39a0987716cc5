"""``ckptdrain serve / status / retry``: the commands that run or talk to this node's daemon.

Expected failures raise typed errors; ``cli.main`` turns them into one sentence and an exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import resource
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from ckptdrain.client import Client, wire
from ckptdrain.client.daemonsocket import default_socket_path
from ckptdrain.daemon.cli_destination import EXIT_OK, EXIT_USAGE, CommandFailed, job_arg, step_arg
from ckptdrain.daemon.cli_destination import human as _human
from ckptdrain.daemon.errors import ConfigError, one_line


def load(ns: argparse.Namespace) -> Any:
    from ckptdrain.daemon.configload import load_config

    return load_config(getattr(ns, "config", None))  # ConfigError: exit 78


def socket_path(ns: argparse.Namespace) -> str:
    if getattr(ns, "socket", None):
        return str(ns.socket)
    if getattr(ns, "config", None) or os.environ.get("CKPTDRAIN_CONFIG"):
        try:
            return str(load(ns).socket)
        except ConfigError as exc:
            # The running daemon has its old config (a reload of a broken file is refused):
            # the operator who broke the file still needs to see it (found attacking).
            raise ConfigError(exc.key, f"{exc.reason}; to reach the running daemon meanwhile, "
                              "name its socket: --socket PATH") from None
    return default_socket_path()


# -- serve ------------------------------------------------------------------------------------
def _raise_fd_limit() -> None:
    """The soft RLIMIT_NOFILE raised to the hard one: started by hand, from a container or a
    batch system, a daemon kept the usual soft 1024, and 1,020 idle connections (under both
    limits.max_clients and its per-uid share) locked every user out, root's `status` too
    (found attacking). Best effort: a limit that cannot be raised is left as it is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit is not a number the kernel takes for the soft one (fs.nr_open).
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def cmd_serve(ns: argparse.Namespace) -> int:
    from ckptdrain.daemon import collector
    from ckptdrain.daemon.logs import setup_logging
    from ckptdrain.daemon.server import Daemon
    from ckptdrain.daemon.systemd import SocketActivationError, listen_fds

    # A reload asked for before the daemon can reload (it loads its config, then serves) is
    # one it would apply to what it is loading anyway; SIGHUP's default ended the process
    # (found attacking: `systemctl reload` right after a start made it fail).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    config = load(ns)
    setup_logging(config.log_level)
    collector.tune()
    _raise_fd_limit()
    try:
        inherited = listen_fds()
    except SocketActivationError as exc:
        raise CommandFailed(str(exc)) from None
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
    from ckptdrain.daemon.journalfaults import JournalError
    from ckptdrain.daemon.metricsendpoint import MetricsServerError

    try:
        runner(daemon.run())
    except BaseExceptionGroup as group:
        # A failure inside the daemon's task group arrives wrapped: show the cause.
        raise _expected(group) from None
    except (JournalError, MetricsServerError, OSError) as exc:
        raise _expected(exc) from None
    ran.set()
    _flush_and_exit(EXIT_OK)
    return EXIT_OK


def _expected(exc: BaseException) -> BaseException:
    """The typed error to report for a failed ``serve`` (the first of a group), or ``exc``."""
    from ckptdrain.daemon.errors import DaemonError, StartupError
    from ckptdrain.daemon.journalfaults import JournalError
    from ckptdrain.daemon.metricsendpoint import MetricsServerError

    if isinstance(exc, BaseExceptionGroup):
        for leaf in exc.exceptions:
            found = _expected(leaf)
            if found is not leaf or isinstance(leaf, DaemonError | OSError):
                return found
        return exc
    if isinstance(exc, MetricsServerError):
        return StartupError("metrics.listen", str(exc))
    if isinstance(exc, JournalError | StartupError):
        return exc
    if isinstance(exc, OSError):
        return StartupError("socket", f"cannot serve: {exc}")
    return exc


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
def _nothing_listed(job: str | None, sock: str) -> str:
    """What an empty listing was filtered by. "no generations on this node" read as an empty
    node (found as a new operator) under `--job typo`, and for a user other than root and the
    daemon's own, who is shown only the jobs it owns, on a node busy with other users' jobs.
    The daemon's own user (a per-user daemon: its socket is the caller's) sees every job."""
    what = f"no generations of job {job!r}" if job else "no generations"
    try:
        own = os.stat(sock).st_uid == os.geteuid()
    except OSError:
        own = False
    if os.geteuid() != 0 and not own:
        return (f"{what} on this node that uid {os.geteuid()} may see (a user sees the jobs it "
                "owns; root sees every one)")
    return f"{what} on this node; `ckptdrain status` lists every job's" if job else \
        f"{what} on this node"


def _ranks_here(g: dict[str, Any]) -> str:
    """This node's ranks of the generation, of its world size: "8/16" says a generation in
    state `recorded` waits for 8 ranks elsewhere. Over 32 ranks the daemon sends counts by
    state, whose len() the column showed as 1 (found as a new operator: 40 ranks read 1)."""
    ranks = g["ranks"]
    counts = ranks.get("count_by_state")
    here = sum(counts.values()) if isinstance(counts, dict) else len(ranks)
    return f"{here}/{g['world_size']}" if "world_size" in g else str(here)


def _retryable(g: dict[str, Any]) -> bool:
    """A failed generation whose shards wait here for `ckptdrain retry`: its failed copies
    are kept, and no rank aborted (those are never retried). The runbook's next step, which
    status left to the operator to know (found as a new operator)."""
    ranks = g["ranks"]
    # Rank states: {rank: state}, or over 32 ranks {"count_by_state": {state: count}}.
    rank_states = ranks["count_by_state"] if "count_by_state" in ranks else set(ranks.values())
    shards = g["shards"]
    return (g["state"] == "failed" and shards.get("failed", 0) > 0
            and "aborted" not in rank_states
            and not shards.get("discarded") and not shards.get("held"))


def cmd_status(ns: argparse.Namespace) -> int:
    sock = socket_path(ns)
    with Client(sock, timeout_s=30) as client:
        status = client.status(ns.job)
    if ns.json:
        print(json.dumps(status, indent=2, sort_keys=True))
        return EXIT_OK
    limits = status["limits"]
    print(f"node {status['node_id']}  ack={status['ack']}  destination {status['destination']}")
    if status.get("draining"):
        print("DRAINING for maintenance: new generations are refused (`ckptdrain resume` undoes it)")
    config = status.get("config") or {}
    if config.get("reload_failed"):
        print(f"CONFIG RELOAD FAILED, the old config runs on: {one_line(config['reload_failed'])}")
    if config.get("needs_restart"):
        print(f"config changed, waiting for a restart: {', '.join(config['needs_restart'])}")
    # A limit clamped to the staging disk's room is not the one in the file (found as a new
    # operator: "of 41.8 GiB" beside a configured 800 GiB, with no word why).
    configured = limits.get("max_staged_bytes_configured")
    clamped = ("" if configured is None else
               f" (limits.max_staged_bytes {_human(configured)} clamped to the staging disk's room)")
    print(
        f"staged {_human(status['staged_bytes'])} of {_human(limits['max_staged_bytes'])}{clamped}"
        f"  queued shards {status['queued_shards']}/{limits['max_queued_shards']}"
        f"  drain {_human(status['drain_rate_bytes_per_s'])}/s"
        f"  blocked hand-offs {status['blocked_handoffs']}"
        + "".join(f" ({n} on {limit})" for limit, n in status.get("blocked_by_limit", {}).items())
    )
    gens = status["generations"]
    if not gens:
        print(_nothing_listed(ns.job, sock))
        return EXIT_OK
    # UNDRAINED: shards not yet at the destination (staged, draining, failed); the header's
    # "staged" is bytes held in staging (found attacking: a column named STAGED read 2 beside
    # "staged 0 B").
    # The job and step columns are as wide as what they hold: a job name past 20 characters
    # (names take up to 128) or a step past 10 digits pushed every column after it out of line.
    jw = max(20, *(len(g["job"]) for g in gens))
    sw = max(10, *(len(str(g["step"])) for g in gens))
    ranks = [_ranks_here(g) for g in gens]
    rw = max(5, *(len(r) for r in ranks))
    header = f"{'JOB':<{jw}} {'STEP':>{sw}} {'STATE':<10} {'UID':>6} {'RANKS':>{rw}} {'UNDRAINED':>9} {'DRAINED':>7} {'BYTES':>11} {'OLDEST':>8}"
    print(header)
    for g, here in zip(gens, ranks, strict=True):
        shards = g["shards"]
        undrained = sum(shards.get(s, 0) for s in ("staged", "draining", "failed"))
        total_bytes = sum(g["bytes"].values())
        print(
            f"{g['job']:<{jw}} {g['step']:>{sw}} {g['state']:<10} {g.get('uid', '-')!s:>6} {here:>{rw}}"
            f" {undrained:>9} {shards.get('drained', 0):>7} {_human(total_bytes):>11}"
            # Nothing undrained has no age ("0.0s" beside a committed step read as just now).
            + (f" {g['oldest_undrained_age_s']:>7.1f}s"
               if undrained or g["oldest_undrained_age_s"] else f" {'-':>8}")
        )
        if g.get("error"):
            print(f"    error: {one_line(g['error'])}")
            if _retryable(g):
                print(f"    its copies are kept here: `ckptdrain retry {g['job']} {g['step']}` "
                      "drains it again once the cause is fixed (`ckptdrain abort "
                      f"{g['job']} {g['step']}` gives it up)")
        elif g.get("retrying"):
            print(f"    retrying: {one_line(g['retrying'])}")
    if status.get("generations_omitted"):
        print(f"... and {status['generations_omitted']} more generations (ended ones with no "
              "failed copies kept left out first); show one job's with --job JOB")
    draining = status.get("shards_draining", [])
    if draining:
        # "Stuck or slow?": a destination that stopped answering shows here as a copy whose
        # last progress grows older, long before its request times out.
        print("draining now, the longest-waiting first:")
        for s in draining:
            print(f"    {s['job']} {s['step']} {one_line(s['path'])}: "
                  f"{_human(s['drained_bytes'])} of {_human(s['size'])}, last progress "
                  f"{s.get('idle_s', 0.0):.0f}s ago")
    uploads = status.get("uploads_open", [])
    if uploads:
        print(f"multipart uploads open: {status.get('uploads_open_count', len(uploads))}, oldest first")
        for u in uploads:
            print(f"    {u['job']} {u['step']} {u['path']} ({_human(u['size'])}, {u['state']}) "
                  f"upload {u['upload_id']} open {u['age_s']:.0f}s")
    return EXIT_OK


def cmd_retry(ns: argparse.Namespace) -> int:
    with Client(socket_path(ns), timeout_s=30) as client:
        result = client.retry(ns.job, ns.step)
    print(f"step {ns.step} of job {ns.job!r}: {result.get('requeued', 0)} shard(s) requeued for draining")
    return EXIT_OK


# -- maintenance --------------------------------------------------------------------------------
DRAIN_POLL_S = 1.0


def _left(report: dict[str, Any]) -> str:
    left = report["left"]
    return (f"{left['shards_undrained']} shard(s) ({_human(left['bytes_undrained'])}) not yet "
            f"drained, {left['shards_receiving']} arriving, {left['generations_unrecorded']} "
            f"generation(s) not yet recorded at the destination"
            + (f"; {left['shards_failed']} failed shard(s) kept for `ckptdrain retry`"
               if left["shards_failed"] else ""))


def cmd_drain(ns: argparse.Namespace) -> int:
    import time

    if ns.timeout is not None and not 0 < ns.timeout < float("inf"):
        raise CommandFailed(f"--timeout must be a positive number of seconds, not {ns.timeout}",
                            EXIT_USAGE)
    if ns.timeout is not None and not ns.wait:
        # Without --wait it was ignored: `drain --timeout 1800 && systemctl stop ...` stopped
        # the daemon at once, mid-save (found as a new operator).
        raise CommandFailed("--timeout bounds --wait, and was given without it; add --wait to "
                            "wait until nothing is left to drain", EXIT_USAGE)
    deadline = None if ns.timeout is None else time.monotonic() + ns.timeout
    # No request may take longer than the whole wait: a daemon that answers nothing (stopped,
    # wedged) made `--timeout 3` take the client's 10 s connect timeout (found attacking it).
    limit = 30.0 if ns.timeout is None else min(30.0, ns.timeout)
    with Client(socket_path(ns), timeout_s=limit, connect_timeout_s=min(10.0, limit)) as client:
        report = client.drain()
        while ns.wait and not report["done"]:
            if deadline is not None and time.monotonic() >= deadline:
                if ns.json:
                    print(json.dumps(report, indent=2, sort_keys=True))
                raise CommandFailed(f"still draining after {ns.timeout:g} s: {_left(report)}; "
                                    "wait longer, or see `ckptdrain status`")
            time.sleep(DRAIN_POLL_S)
            report = client.drain()
    if ns.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    elif report["done"] and report["left"]["shards_failed"]:
        # Found attacking: this said "safe to stop" alone, and an operator draining the node to
        # reimage it lost the only copies of checkpoints `retry` could still have committed.
        left = report["left"]
        print(f"node drained: new generations are refused and nothing more will drain; but "
              f"{left['shards_failed']} failed shard(s) ({_human(left.get('bytes_failed', 0))}) "
              "have their only copy on this node, kept for `ckptdrain retry` (`ckptdrain "
              "status` lists their generations): retry them once the destination is fixed, or "
              "give them up, before this node's staging is wiped. Stopping the daemon keeps "
              "them (`ckptdrain resume` takes new generations again)")
    elif report["done"]:
        print("node drained: new generations are refused and nothing is left to drain; it is "
              "safe to stop the daemon (`ckptdrain resume` takes new generations again)")
    else:
        print(f"draining: new generations are refused; left: {_left(report)} "
              "(`ckptdrain drain --wait` waits for it)")
    return EXIT_OK


def cmd_resume(ns: argparse.Namespace) -> int:
    with Client(socket_path(ns), timeout_s=30) as client:
        client.resume()
    print("resumed: the node takes new generations again")
    return EXIT_OK


def cmd_abort(ns: argparse.Namespace) -> int:
    with Client(socket_path(ns), timeout_s=30) as client:
        result = client.abort_generation(ns.job, ns.step, ns.reason or "")
    print(f"step {ns.step} of job {ns.job!r} aborted on this node ({result['state']}); it will "
          "never commit from this attempt: save a new step")
    return EXIT_OK


def _reason_arg(text: str) -> str:
    """A usage error (exit 2) past the length the daemon takes: it was refused by the daemon
    as a failed command (exit 1; found attacking)."""
    if len(text) > wire.MAX_REASON_CHARS:
        raise argparse.ArgumentTypeError(f"at most {wire.MAX_REASON_CHARS} characters (got "
                                         f"{len(text)})")
    return text


def add_parsers(sub: Any, common: Callable[..., None]) -> None:
    p = sub.add_parser("serve", help="run the daemon in the foreground")
    common(p)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("status", help="what the node's daemon holds and how far it has drained")
    common(p, socket=True)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--job", type=job_arg, help="show only this job's generations")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("retry", help="drain a failed generation again from its local copy")
    common(p, socket=True)
    p.add_argument("job", type=job_arg, help="the training job's name")
    p.add_argument("step", type=step_arg, help="the generation (step) number")
    p.set_defaults(fn=cmd_retry)

    p = sub.add_parser("drain", help="take the node out of service: refuse new generations, "
                       "finish what is staged")
    common(p, socket=True)
    p.add_argument("--wait", action="store_true", help="return once nothing is left to drain")
    p.add_argument("--timeout", type=float, metavar="S",
                   help="with --wait: give up after S seconds (exit 1, saying what is left)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_drain)

    p = sub.add_parser("resume", help="take new generations again after `drain`")
    common(p, socket=True)
    p.set_defaults(fn=cmd_resume)

    p = sub.add_parser("abort", help="end one generation on this node (it will never commit)")
    common(p, socket=True)
    p.add_argument("job", type=job_arg, help="the training job's name")
    p.add_argument("step", type=step_arg, help="the generation (step) number")
    p.add_argument("--reason", type=_reason_arg, help="recorded with the failure "
                   f"(at most {wire.MAX_REASON_CHARS} characters)")
    p.set_defaults(fn=cmd_abort)
