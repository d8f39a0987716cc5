"""One kill-matrix trial, drawn entirely from its seed.

A trial: start a daemon (maybe under strace, maybe behind the S3 fault proxy), play a
workload, kill -9 the daemon (at a moment, at the N-th acknowledged put, or at a syscall),
check what must hold at any moment, restart it (maybe killing it again during recovery),
let it recover, then check every invariant and stop it cleanly. ``CHAOS_SEED=<n>`` replays
trial ``n``: the same plan, faults, limits and kill points.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptdrain.client import Client, DrainError, GenerationFailed, NotFound, Timeout
from tests.chaos import invariants as inv
from tests.chaos.killer import ChaosDaemon, Injection, Killer, on_ack_kill, random_injection
from tests.chaos.proxy import ChaosProxy
from tests.chaos.workload import Expect, Plan, Record, Workload, make_plan

MiB = 1 << 20
RSS_LIMIT_BYTES = 768 * MiB  # a Python daemon with aiobotocore idles near 100 MiB
FD_SLACK = 32  # pooled S3 connections, thread-pool wakeup pipes, the journal's WAL and shm
TALLY = {"trials": 0, "kills": 0}  # for the run's summary line (conftest.py)


@dataclass
class S3Target:
    """The real server (for checks), a bucket shared by trials, each under its own prefix."""

    endpoint_url: str
    bucket: str
    client: Any


@dataclass
class TrialSpec:
    seed: int
    dest: str  # "file" or "s3"
    fault: str  # "timer", "acks", "strace" or "proxy"
    plan: Plan
    env: dict[str, str]
    max_staged_bytes: int
    keep_local_copy: bool
    injection: Injection | None = None
    kill_after_s: float | None = None
    kill_at_ack: int | None = None
    second_kill_after_s: float | None = None
    proxy_rate: float = 0.0

    def describe(self) -> str:
        what = {"timer": f"kill -9 after {self.kill_after_s} s",
                "acks": f"kill -9 at ack #{self.kill_at_ack}",
                "strace": f"strace {self.injection.describe() if self.injection else ''}",
                "proxy": f"S3 faults at {self.proxy_rate:.0%}, kill -9 after {self.kill_after_s} s"}
        second = (f", again {self.second_kill_after_s} s into the restart"
                  if self.second_kill_after_s is not None else "")
        engine = self.env.get("CKPTDRAIN_DESTINATION__ENGINE")
        dest = f"{self.dest} ({engine})" if engine else self.dest
        return (f"seed {self.seed}: {dest}, {what[self.fault]}{second}; "
                f"max_staged_bytes={self.max_staged_bytes} keep_local_copy={self.keep_local_copy}; "
                f"{len(self.plan.generations)} generations, {self.plan.total_shards} shards")


def dest_of(seed: int) -> str:
    return "s3" if seed % 4 == 0 else "file"


def trial_spec(seed: int, *, multipart: bool = True) -> TrialSpec:
    rng = random.Random(seed)
    dest = dest_of(seed)
    plan = make_plan(rng, f"chaos-{seed}", big_shards=dest == "s3" and multipart and rng.random() < 0.5)
    faults = ["timer", "acks", "strace"] + (["proxy"] if dest == "s3" else [])
    fault = rng.choice(faults)
    max_staged = max(rng.choice((4 * MiB, 16 * MiB, 256 * MiB)), plan.largest_shard)
    keep_local = rng.random() < 0.5
    env = {
        "CKPTDRAIN_LIMITS__MAX_STAGED_BYTES": str(max_staged),
        "CKPTDRAIN_LIMITS__MAX_GENERATIONS_IN_FLIGHT": "8",
        "CKPTDRAIN_LIMITS__BLOCK_TIMEOUT_S": "3",
        "CKPTDRAIN_RETENTION__KEEP_LAST": "1000",  # every committed generation stays checkable
        "CKPTDRAIN_RETENTION__KEEP_LOCAL_COPY": "true" if keep_local else "false",
        "CKPTDRAIN_DRAIN__RETRY_BUDGET_S": "5",
        "CKPTDRAIN_DRAIN__RETRY_MAX_BACKOFF_S": "0.5",
        "CKPTDRAIN_DESTINATION__MAX_CONCURRENCY": str(rng.randint(1, 4)),
    }
    if dest == "s3":
        env |= {
            "CKPTDRAIN_DESTINATION__PART_SIZE_BYTES": "8MiB",
            "CKPTDRAIN_DESTINATION__MULTIPART_THRESHOLD_BYTES": "8MiB",
            "CKPTDRAIN_DESTINATION__READ_TIMEOUT_S": "3",
            "CKPTDRAIN_DESTINATION__CONNECT_TIMEOUT_S": "2",
            "CKPTDRAIN_DESTINATION__MAX_ATTEMPTS": "3",
            # One node writes the trial's prefix: at a restart every upload its journal does
            # not own is an orphan (a lost CreateMultipartUpload answer leaves one the SDK's
            # retry never learns the id of), and the start-up sweep must abort it.
            "CKPTDRAIN_DESTINATION__ORPHAN_GRACE_S": "0",
            # Half the trials send single PUTs and the commit's HEADs through the AWS common
            # runtime. Drawn from its own generator, so the other draws (and the fixed seeds
            # of `make test`'s slice) stay as they were.
            "CKPTDRAIN_DESTINATION__ENGINE": "crt" if random.Random(seed ^ 0xC127).random() < 0.5
            else "aiobotocore",
        }
    spec = TrialSpec(seed=seed, dest=dest, fault=fault, plan=plan, env=env,
                     max_staged_bytes=max_staged, keep_local_copy=keep_local)
    if fault == "timer":
        spec.kill_after_s = round(rng.uniform(0.05, 1.5), 3)
    elif fault == "acks":
        spec.kill_at_ack = rng.randint(1, max(1, plan.total_shards))
    elif fault == "strace":
        spec.injection = random_injection(rng)
    else:
        spec.proxy_rate = rng.uniform(0.05, 0.25)
        spec.kill_after_s = round(rng.uniform(0.2, 3.0), 3)
    if rng.random() < 0.3:
        spec.second_kill_after_s = round(rng.uniform(0.0, 0.6), 3)
    return spec


@dataclass
class Trial:
    spec: TrialSpec
    root: Path
    socket_dir: Path
    s3: S3Target | None = None
    violations: list[str] = field(default_factory=list)
    kills: int = 0
    notes: list[str] = field(default_factory=list)
    record: Record | None = None

    def run(self) -> Trial:
        spec = self.spec
        proxy = None
        env = dict(spec.env)
        if spec.dest == "s3":
            assert self.s3 is not None
            uri = f"s3://{self.s3.bucket}/c{spec.seed}"
            endpoint = self.s3.endpoint_url
            if spec.fault == "proxy":
                proxy = ChaosProxy(self.s3.endpoint_url, seed=spec.seed)
                endpoint = proxy.endpoint_url
                rates = proxy.random_faults(random.Random(spec.seed ^ 0x5EED), spec.proxy_rate)
                self.notes.append(f"proxy rates {rates}")
            env["CKPTDRAIN_DESTINATION__ENDPOINT_URL"] = endpoint
            dest: inv.Destination = inv.S3Destination(self.s3.client, self.s3.bucket, f"c{spec.seed}")
        else:
            uri = f"file://{self.root / 'dest'}"
            dest = inv.PosixDestination(self.root / "dest")
        self.daemon = ChaosDaemon(root=self.root, socket_path=self.socket_dir / "d.sock",
                                  dest_uri=uri, overrides=env, injection=spec.injection)
        try:
            self._run(dest, proxy)
        finally:
            TALLY["trials"] += 1
            TALLY["kills"] += self.kills
            self.daemon.kill()
            if proxy is not None:
                proxy.close()
        return self

    def _pid(self) -> int | None:
        with contextlib.suppress(RuntimeError, AssertionError):
            return self.daemon.pid if self.daemon.alive() else None
        return None

    def _run(self, dest: inv.Destination, proxy: ChaosProxy | None) -> None:
        spec, d = self.spec, self.daemon
        workload = Workload(spec.plan, d.socket_path, self.root / "files")
        workload.prepare()
        obs = inv.Observer(dest, spec.plan.job, d.staging / "shards", self._pid,
                           interval_s=0.01 if spec.dest == "file" else 0.05)
        try:
            d.start(timeout_s=15)
        except RuntimeError:  # an injected fault stopped it from starting (or serving) at all
            self._judge_death("while starting")
            d.injection = None
            d.start()
        baseline_fds = inv.proc_fds(d.pid)
        obs.start()
        killer = Killer(d, after_s=spec.kill_after_s).start()
        if spec.kill_at_ack is not None:
            workload.on_ack = on_ack_kill(killer, spec.kill_at_ack)
        self.record = record = workload.run(stop=killer.killed)
        if not d.alive() and not killer.killed.is_set():
            self._judge_death("during the workload")
        killer.finish()
        self.kills += 1
        self.notes.append(f"kill #1: {killer.reason} (daemon was {'alive' if killer.was_alive else 'already dead: ' + d.died_by()})")
        # What must hold at every moment, also right after a crash.
        self.violations += inv.check_destination(dest, spec.plan, record, settled=False)
        d.injection = None
        if proxy is not None:
            proxy.calm()
        if spec.second_kill_after_s is not None:
            again = Killer(d, after_s=spec.second_kill_after_s, restart=True).start()
            with contextlib.suppress(RuntimeError):  # killed before it was ready
                d.start()
            again.finish()
            self.kills += 1
            self.notes.append(f"kill #2: {spec.second_kill_after_s} s into the restart")
            self.violations += inv.check_destination(dest, spec.plan, record, settled=False)
        d.start()
        self._settle(record)
        self.violations += inv.check_destination(dest, spec.plan, record, settled=True)
        self.violations += inv.check_latest(dest, spec.plan.job, obs.latest)
        if spec.dest == "s3":
            self.violations += inv.check_uploads(dest)
        limit = baseline_fds + FD_SLACK
        if not inv.wait_until(lambda: inv.proc_fds(d.pid) <= limit, 10.0):
            self.violations.append(f"daemon holds {inv.proc_fds(d.pid)} fds at rest, "
                                   f"{baseline_fds} after its first start")
        obs.stop()
        # Local copies (keep_local_copy) live inside max_staged_bytes too: one shard of slack
        # is for a hand-off whose file exists a moment before its reservation is counted.
        self.violations += inv.check_bounds(obs, max_staged_bytes=spec.max_staged_bytes,
                                            slack_bytes=spec.plan.largest_shard,
                                            rss_limit=RSS_LIMIT_BYTES,
                                            fd_limit=baseline_fds + FD_SLACK + 64)
        rc = d.stop()
        if rc != 0:
            self.violations.append(f"SIGTERM after recovery: the daemon exited {rc}")

    def _judge_death(self, when: str) -> None:
        """The daemon died on its own under an injected errno. Losing its journal (SQLite's
        files) may stop a daemon: it can no longer keep its promises. An errno on a staged
        shard, the destination or anything else must not: the request or the generation
        fails with a typed error and the daemon carries on (docs/failure-semantics.md)."""
        inj = self.spec.injection
        if inj is None or not inj.errno:
            return  # an injected SIGKILL: the kill this trial is about
        hit = self.daemon.tampered_with()
        self.notes.append(f"daemon died {when} ({self.daemon.died_by()}); the errno hit {sorted(hit)}")
        if when == "while starting":
            # Refusing to start on a broken disk is right, but with one clear sentence. (An
            # errno that stops the interpreter itself, before any ckptdrain code, is not ours.)
            log = self.daemon.log()
            if "Traceback" in log and "Fatal Python error" not in log:
                self.violations.append(
                    f"start-up under an injected {inj.errno} ({inj.describe()}, hitting "
                    f"{sorted(hit)}) ended in a traceback, not one sentence naming the cause")
        elif hit - {"journal", "impossible"}:
            self.violations.append(
                f"the daemon died {when} ({self.daemon.died_by()}) on an injected {inj.errno} "
                f"({inj.describe()}, hitting {sorted(hit - {'journal', 'impossible'})}); it should have failed "
                "the request or the generation with a typed error and carried on")

    def _settle(self, record: Record) -> None:
        """Recovery as the contract states it: every generation all of whose ranks sealed
        commits (an injected destination fault may fail it with a typed error; ``retry``
        must then commit it from the kept local copy); any other reaches an end."""
        job = self.spec.plan.job
        faulty = self.spec.fault == "proxy" or bool(self.spec.injection and self.spec.injection.errno)
        with Client(self.daemon.socket_path, timeout_s=120) as c:
            for step, rec in sorted(record.gens.items()):
                expect = rec.expect
                try:
                    c.wait(job, step, timeout_s=0 if expect is Expect.NEVER else 60)
                except (Timeout, NotFound, GenerationFailed) as exc:
                    if expect is Expect.MUST_COMMIT:
                        if faulty and isinstance(exc, GenerationFailed):
                            self.notes.append(f"step {step} failed ({exc}); retrying")
                            try:
                                c.retry(job, step)
                                c.wait(job, step, timeout_s=60)
                            except DrainError as again:
                                self.violations.append(f"step {step}: retry after a typed failure "
                                                       f"did not commit it: {again}")
                        else:
                            self.violations.append(f"step {step} ({expect.value}): {type(exc).__name__}: {exc}")
                    elif expect is Expect.MAY_COMMIT and isinstance(exc, Timeout):
                        self.violations.append(f"step {step} ({expect.value}) neither committed "
                                               f"nor failed: {exc}")

    def report(self) -> str:
        d = self.daemon
        return inv.render(
            f"chaos trial failed; reproduce with CHAOS_SEED={self.spec.seed}\n{self.spec.describe()}",
            self.violations,
            {"what happened": "\n".join(self.notes),
             "workload": self.record.summary() if self.record is not None else "",
             "strace tampered with": "\n".join(d.injected()[-20:]),
             "daemon logs (tails)": d.log_excerpt()})
