"""Commands an operator runs on a node: ``config check / show``, ``drain`` (and ``resume``)
to take the node out for maintenance, ``abort JOB STEP``, and what ``status`` says about
owners. Each is the real ``ckptdrain`` against a real daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import Backpressure, DrainError, GenerationFailed, NodeDraining
from ckptdrain.daemon.configload import load_config
from tests.conftest import CKPTDRAIN, DaemonProcess, fill_up, wait_for
from tests.functional.test_startup import scrape


def cli(d: DaemonProcess, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CKPTDRAIN, *args], env={**d.env(), **env}, capture_output=True,
                          text=True, timeout=120, check=False)


# -- config ---------------------------------------------------------------------------------------
def test_config_check(make_daemon: Any, tmp_path: Path) -> None:
    d: DaemonProcess = make_daemon(start=False)
    out = cli(d, "config", "check")
    assert out.returncode == 0, out.stderr
    assert "configuration OK" in out.stdout and "CKPTDRAIN_STAGING_DIR" in out.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('[limits]\nmax_staged_bytes = "lots"\n')
    out = cli(d, "config", "check", "--config", str(bad))
    assert out.returncode == 78 and "limits.max_staged_bytes" in out.stderr and str(bad) in out.stderr
    out = cli(d, "config", "check", "--config", str(tmp_path / "missing.toml"))
    assert out.returncode == 78 and "no such config file" in out.stderr


def test_config_show_is_the_effective_config_as_loadable_toml(make_daemon: Any,
                                                             tmp_path: Path) -> None:
    d: DaemonProcess = make_daemon(start=False, CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="3GiB")
    out = cli(d, "config", "show")
    assert out.returncode == 0, out.stderr
    assert "max_staged_bytes = 3221225472  # 3.0 GiB; set by CKPTDRAIN_LIMITS__MAX_STAGED_BYTES" \
        in out.stdout
    shown = tmp_path / "shown.toml"
    shown.write_text(out.stdout)
    tomllib.loads(out.stdout)  # valid TOML
    env = {k: v for k, v in d.env().items() if not k.startswith("CKPTDRAIN_")}
    assert load_config(shown, env=env) == load_config(env=d.env())
    doc = json.loads(cli(d, "config", "show", "--json").stdout)
    assert doc["config"]["limits"]["max_staged_bytes"] == 3 << 30
    assert doc["set_by_environment"]["limits.max_staged_bytes"] == "CKPTDRAIN_LIMITS__MAX_STAGED_BYTES"


# -- drain / resume -------------------------------------------------------------------------------
def test_drain_for_maintenance_then_resume(make_daemon: Any) -> None:
    d: DaemonProcess = make_daemon()
    c = d.client()
    rank0 = c.generation("train", 1, rank=0, world_size=2)
    rank0.__enter__()
    rank0.put("r0", os.urandom(1 << 16))

    out = cli(d, "drain", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["draining"] is True and report["done"] is False
    assert report["left"]["generations_unrecorded"] == 1

    # A new generation is refused with a typed error a training loop can act on...
    with pytest.raises(NodeDraining) as refused:
        c.generation("train", 2).__enter__()
    assert isinstance(refused.value, Backpressure) and refused.value.code == "draining"
    assert "ckptdrain resume" in refused.value.message
    # ... but the generation in progress is finished: its other rank still joins.
    with c.generation("train", 1, rank=1, world_size=2) as gen:
        gen.put("r1", os.urandom(1 << 16))
    rank0.__exit__(None, None, None)
    c.wait("train", 1, timeout_s=60)

    out = cli(d, "drain", "--wait", "--timeout", "60")
    assert out.returncode == 0, out.stderr
    assert "safe to stop the daemon" in out.stdout
    status = json.loads(cli(d, "status", "--json").stdout)
    assert status["draining"] is True
    assert "DRAINING" in cli(d, "status").stdout

    out = cli(d, "resume")
    assert out.returncode == 0 and "takes new generations" in out.stdout
    with c.generation("train", 2) as gen:
        gen.put("w", b"after maintenance")
    c.wait("train", 2, timeout_s=60)


def test_drain_wait_gives_up_at_its_timeout_saying_what_is_left(make_daemon: Any) -> None:
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")
    with d.client().generation("slow", 1) as gen:
        gen.put("w", os.urandom(1 << 20))  # takes days at 1 B/s
    started = time.monotonic()
    out = cli(d, "drain", "--wait", "--timeout", "2")
    assert out.returncode == 1, out.stdout + out.stderr
    assert time.monotonic() - started < 60
    [line] = out.stderr.splitlines()
    assert "still draining after 2 s" in line and "1 shard(s) (1.0 MiB) not yet drained" in line
    assert cli(d, "drain", "--timeout", "0").returncode == 2
    # Found as a new operator: without --wait, --timeout was ignored and the drain returned at
    # once, exit 0, with the shard still undrained (`drain --timeout 1800 && systemctl stop`).
    out = cli(d, "drain", "--timeout", "1800")
    assert out.returncode == 2 and "add --wait" in out.stderr, out.stdout + out.stderr


def test_drain_wait_against_a_daemon_that_answers_nothing_ends_at_its_timeout(
    make_daemon: Any
) -> None:
    # Found attacking the CLI: against a stopped daemon, `--timeout 3` took the client's
    # 10 s connect timeout.
    d: DaemonProcess = make_daemon()
    assert d.proc is not None
    d.proc.send_signal(signal.SIGSTOP)
    try:
        out = subprocess.run([CKPTDRAIN, "drain", "--wait", "--timeout", "1"], env=d.env(),
                             capture_output=True, text=True, timeout=7, check=False)
    finally:
        d.proc.send_signal(signal.SIGCONT)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr


# -- abort ----------------------------------------------------------------------------------------
def test_abort_a_generation(make_daemon: Any) -> None:
    d: DaemonProcess = make_daemon()
    c = d.client()
    stuck = c.generation("job", 5, rank=0, world_size=2)
    stuck.__enter__()
    stuck.put("w", b"half a checkpoint")
    out = cli(d, "abort", "job", "5", "--reason", "node 7 is gone")
    assert out.returncode == 0, out.stderr
    assert "never commit" in out.stdout
    [gen] = c.status()["generations"]
    assert gen["state"] == "failed" and "aborted by an operator" in gen["error"]
    assert "node 7 is gone" in gen["error"]
    with pytest.raises(GenerationFailed):
        stuck.__exit__(None, None, None)
    again = cli(d, "abort", "job", "5")
    assert again.returncode == 1 and "already failed" in again.stderr
    missing = cli(d, "abort", "job", "6")
    assert missing.returncode == 1 and "holds no step 6" in missing.stderr
    assert cli(d, "abort", "bad job", "6").returncode == 2
    # A reason longer than the daemon takes is a usage error too (it failed as exit 1).
    long = cli(d, "abort", "job", "6", "--reason", "x" * 1001)
    assert long.returncode == 2 and "at most 1000 characters" in long.stderr, long.stderr


def test_an_aborted_generation_gives_back_what_it_staged_at_once(make_daemon: Any) -> None:
    # Found in a long run with operator aborts: the abort ended the generation while its rank
    # was still open, so it still looked retryable and its undrained shards were kept for a
    # retry; the rank's abort that followed made it unretryable, and nothing gave them back.
    # They stayed staged (the oldest-undrained age climbed, paging for nothing) until the
    # generation was forgotten, days later. Now an operator's abort gives the generation up.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")
    c = d.client()
    rank = c.generation("job", 5, rank=0, world_size=1)
    rank.__enter__()
    for i in range(3):
        rank.put(f"w{i}", os.urandom(300_000))
    assert c.status()["staged_bytes"] >= 900_000
    assert cli(d, "abort", "job", "5").returncode == 0
    status = c.status()
    assert status["staged_bytes"] == 0 and status["queued_shards"] == 0, status
    assert not status["oldest_undrained_age_s"], status  # nothing left to page about
    with pytest.raises(GenerationFailed, match="cannot be retried"):
        c.retry("job", 5)
    with pytest.raises(GenerationFailed):
        rank.__exit__(None, None, None)
    assert c.status()["staged_bytes"] == 0
    assert not list((d.staging / "shards").glob("*.data"))


def test_status_shows_the_owning_uid(daemon: DaemonProcess) -> None:
    with daemon.client().generation("owned", 1) as gen:
        gen.put("w", b"x")
    daemon.client().wait("owned", 1, timeout_s=60)
    [gen] = json.loads(cli(daemon, "status", "--json").stdout)["generations"]
    assert gen["uid"] == os.getuid()
    text = cli(daemon, "status").stdout
    assert "UID" in text and f" {os.getuid()} " in text


def test_an_abort_racing_the_commit_never_contradicts_the_manifest(make_daemon: Any) -> None:
    # Found racing aborts with commits: an abort that landed while the manifest was written
    # answered "failed" and `wait` said failed, yet the manifest existed (19 of 100 steps);
    # one that landed while the part record was written failed the commit as an internal
    # error (IllegalTransition), which pages. The abort now waits for this node's commit
    # step to finish: the step either committed (the abort says so) or failed as aborted.
    d: DaemonProcess = make_daemon(CKPTDRAIN_LOG_LEVEL="info")
    c, operator = d.client(timeout_s=30), d.client(timeout_s=30)
    for step in range(1, 81):
        with c.generation("raced", step, rank=0, world_size=1) as gen:
            gen.put("a.bin", b"x" * 4096)
        time.sleep((step % 9) * 0.003)
        try:
            operator.abort_generation("raced", step, reason="raced")
            aborted = True
        except DrainError:
            aborted = False  # committed first
        manifest = d.dest / "raced" / f"{step:020d}" / "MANIFEST.json"
        if aborted:
            with pytest.raises(GenerationFailed, match="aborted by an operator"):
                c.wait("raced", step, timeout_s=15)
            assert not manifest.exists(), f"step {step}: aborted, yet committed"
        else:
            assert c.wait("raced", step, timeout_s=15)["committed"]
            assert manifest.exists()
    assert "commit_crashed" not in d.log() and "unexpectedly" not in d.log()


def test_an_abort_after_this_node_recorded_keeps_other_nodes_from_committing(
        make_daemon: Any) -> None:
    # Found racing aborts: node a had recorded its rank (part record written) when the
    # operator aborted the step there; the rank was left recorded, no failure record was
    # written, and node b committed the step from node a's record while node a said failed.
    a: DaemonProcess = make_daemon("node-a")
    b: DaemonProcess = make_daemon("node-b")
    with a.client().generation("two", 7, rank=0, world_size=2) as gen:
        gen.put("r0.bin", b"a" * 4096)
    deadline = time.monotonic() + 30
    while next(g for g in a.client().status()["generations"] if g["step"] == 7)["state"] != \
            "recorded":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert cli(a, "abort", "two", "7").returncode == 0
    with b.client().generation("two", 7, rank=1, world_size=2) as gen:
        gen.put("r1.bin", b"b" * 4096)
    for node in (a, b):
        with pytest.raises(GenerationFailed, match="aborted"):
            node.client().wait("two", 7, timeout_s=30)
    assert not (a.dest / "two" / f"{7:020d}" / "MANIFEST.json").exists()


def test_a_retried_generation_holds_its_slot(make_daemon: Any) -> None:
    # Found racing aborts and retries: `retry` handed the slot over while the generation was
    # still failed, and the slot of an ended generation is given back at once, so the retried
    # generation ran with none and max_generations_in_flight = 1 let a second step begin.
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_GENERATIONS_IN_FLIGHT="1",
                                   CKPTDRAIN_LIMITS__BLOCK_TIMEOUT_S="1",
                                   CKPTDRAIN_DRAIN__RETRY_BUDGET_S="1",
                                   CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="200000")
    c = d.client(timeout_s=30)
    blocker = d.dest / "job" / f"{1:020d}"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a directory")  # step 1 cannot drain
    # Deferred: its drain comes after the rank sealed, so it fails a sealed generation, which
    # a retry takes (drained at once, it failed the rank's seal now and then, and a step that
    # failed while a rank was still handing off cannot be retried).
    with c.generation("job", 1) as gen:
        gen.put("a.bin", b"a" * (1 << 20), deferred=True)
    with pytest.raises(GenerationFailed):
        c.wait("job", 1, timeout_s=30)
    blocker.unlink()
    c.retry("job", 1)  # 1 MiB at 200 kB/s: in flight for about 5 s
    with pytest.raises(Backpressure, match="max_generations_in_flight"), \
            c.generation("job", 2) as gen:
        gen.put("b.bin", b"b")
    assert c.wait("job", 1, timeout_s=60)["committed"]


def test_a_failed_generation_can_be_given_up(make_daemon: Any) -> None:
    # Found racing aborts: a generation that failed to drain kept its undrained copy for a
    # retry, and `ckptdrain abort` refused it ("already failed"), so nothing let the copy go
    # before the generation was forgotten (a day) while the oldest-undrained age climbed.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__RETRY_BUDGET_S="1")
    c = d.client()
    blocker = d.dest / "job" / f"{1:020d}"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a directory")
    # Deferred: its drain fails (not a directory: no retry) after the rank sealed, which keeps
    # the copy for a retry (drained at once, it failed before the seal now and then, and the
    # copy of a rank that was still handing off is not kept).
    with c.generation("job", 1) as gen:
        gen.put("a.bin", os.urandom(300_000), deferred=True)
    with pytest.raises(GenerationFailed):
        c.wait("job", 1, timeout_s=30)
    assert c.status()["staged_bytes"] >= 300_000
    out = cli(d, "abort", "job", "1")
    assert out.returncode == 0, out.stderr
    status = c.status()
    assert status["staged_bytes"] == 0 and not status["oldest_undrained_age_s"], status
    again = cli(d, "abort", "job", "1")
    assert again.returncode == 1 and "nothing to abort" in again.stderr


def test_an_abort_does_not_wait_out_a_paced_drain(make_daemon: Any) -> None:
    # Found attacking the fix above: an abort that waited for the whole commit's lock waited
    # out a paced drain of deferred shards (done under that lock), timed out after 30 s, and
    # the step then committed. Only the manifest's create is exclusive with an abort now.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="20000")
    c = d.client(timeout_s=30)
    with c.generation("job", 1) as gen:
        gen.put("a.bin", os.urandom(1 << 20), deferred=True)  # about 50 s at 20 kB/s
    deadline = time.monotonic() + 30
    while next(g for g in c.status()["generations"] if g["step"] == 1)["state"] != "recorded":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    out = cli(d, "abort", "job", "1", "--reason", "stuck")
    assert out.returncode == 0, out.stderr
    with pytest.raises(GenerationFailed, match="aborted by an operator"):
        c.wait("job", 1, timeout_s=30)
    assert not (d.dest / "job" / f"{1:020d}" / "MANIFEST.json").exists()
    assert c.status()["staged_bytes"] == 0


def test_a_ranks_abort_does_not_wait_out_part_record_retries(make_daemon: Any,
                                                              tmp_path: Path) -> None:
    # Found attacking the fix above: a rank whose training code raised waited for the
    # other rank's part record, retried against a destination that was not mounted, for the
    # whole retry budget (34-38 s of 60), and the step then failed as a drain error (paging)
    # instead of as aborted.
    mount_point = tmp_path / "lustre"
    mount_point.mkdir()
    d: DaemonProcess = make_daemon(dest=f"file://{mount_point}/proj/ckpt",
                                   CKPTDRAIN_DRAIN__RETRY_BUDGET_S="60")
    c = d.client(timeout_s=120)
    with c.generation("job", 1, rank=0, world_size=2) as gen:
        gen.put("a.bin", b"a" * 4096, deferred=True)  # sealed: its part record is retried
    with pytest.raises(RuntimeError, match="training crashed"), \
            c.generation("job", 1, rank=1, world_size=2) as gen:
        gen.put("b.bin", b"b" * 100)
        raise RuntimeError("training crashed")
    with pytest.raises(GenerationFailed, match="the client aborted: RuntimeError"):
        c.wait("job", 1, timeout_s=30)


def test_drain_says_which_failed_copies_only_this_node_holds(make_daemon: Any,
                                                             small_tmpfs: Path) -> None:
    # Found attacking: with a generation failed on a full destination (its copy kept here for
    # `ckptdrain retry`), `drain --wait` said only "safe to stop the daemon"; an operator
    # draining the node to reimage it would lose the only copy.
    dest = small_tmpfs / "dest"
    dest.mkdir()
    d: DaemonProcess = make_daemon(dest=dest.as_uri())
    fill_up(small_tmpfs)  # the destination's filesystem
    c = d.client()
    with c.generation("full", 1) as gen:
        gen.put("w.bin", os.urandom(2 << 20))
    with pytest.raises(GenerationFailed):
        c.wait("full", 1, timeout_s=60)
    out = cli(d, "drain", "--wait", "--timeout", "60")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 failed shard(s) (2.0 MiB) have their only copy on this node" in out.stdout
    assert "ckptdrain retry" in out.stdout and "safe to stop" not in out.stdout
    report = json.loads(cli(d, "drain", "--json").stdout)
    assert report["left"]["shards_failed"] == 1 and report["left"]["bytes_failed"] == 2 << 20
    # The failed shard counts as not drained, under a column that says so (it was STAGED,
    # beside a header line saying "staged 0 B").
    listing = cli(d, "status").stdout.splitlines()
    [header] = [line for line in listing if line.startswith("JOB")]
    assert "UNDRAINED" in header.split() and "STAGED" not in header.split()
    # And the generation says what to do with it (found as a new operator: the runbook knew,
    # status did not say).
    assert "    its copies are kept here: `ckptdrain retry full 1` drains it again once the " \
        "cause is fixed (`ckptdrain abort full 1` gives it up)" in listing, listing


def test_status_counts_a_generations_ranks_here_of_its_world_size(make_daemon: Any) -> None:
    # Found as a new operator: past 32 ranks on the node the daemon sends counts by state,
    # and the RANKS column showed the length of that dict: 40 ranks read "1". And "recorded"
    # beside "1" did not say the generation waits for ranks on other nodes.
    d: DaemonProcess = make_daemon()
    c = d.client()

    def rank(r: int) -> None:
        with c.generation("wide", 1, rank=r, world_size=48) as gen:
            gen.put(f"r{r}", b"x")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    with c.generation("narrow", 1, rank=0, world_size=2) as gen:
        gen.put("r0", b"x")
    assert "count_by_state" in c.status("wide")["generations"][0]["ranks"]
    rows = {line.split()[0]: line.split() for line in cli(d, "status").stdout.splitlines()
            if line.startswith(("wide ", "narrow "))}
    assert rows["wide"][4] == "40/48" and rows["narrow"][4] == "1/2", rows


def test_status_shows_a_clients_error_text_on_one_line_with_no_terminal_escapes(
        make_daemon: Any) -> None:
    # Found attacking: an exception's message reaches the generation's error (the rank aborts
    # with it), and `status` printed it raw: a newline forged a log-like line in the table, a
    # terminal escape reached the operator's terminal.
    d: DaemonProcess = make_daemon()
    with pytest.raises(RuntimeError), d.client().generation("oom", 1):
        raise RuntimeError("CUDA out of memory\nts=2099 level=error \x1b[31mRED\x1b[0m")
    out = cli(d, "status", "--job", "oom")
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout
    [line] = [line for line in out.stdout.splitlines() if "CUDA out of memory" in line]
    assert line.startswith("    error: ") and "\\nts=2099 level=error \\x1b[31mRED" in line
    assert not any(line.startswith("ts=2099") for line in out.stdout.splitlines())
    assert "ckptdrain retry" not in out.stdout  # an aborted rank is never retried


def test_status_columns_stay_in_line_with_long_job_names_and_steps(daemon: DaemonProcess) -> None:
    # Found attacking: the job column was 20 wide and the step 10, so a longer job name (they
    # take up to 128 bytes) or a step past 10 digits pushed that row's columns out of line
    # with the header and the other rows.
    long_job = "pretrain-" + "x" * 90
    for job, step in ((long_job, 1), ("short", 12345678901234)):
        with daemon.client().generation(job, step) as gen:
            gen.put("w", b"x")
        daemon.client().wait(job, step, timeout_s=60)
    lines = cli(daemon, "status").stdout.splitlines()
    [header] = [line for line in lines if line.startswith("JOB")]
    rows = [line for line in lines if line.startswith((long_job, "short "))]
    assert len(rows) == 2
    for row in rows:
        # STATE starts where the header says, and each row is as long as the header.
        assert row[header.index("STATE"):].startswith("committed"), (header, row)
        assert len(row) == len(header), (header, row)
        # A committed step has nothing undrained, so no oldest age (it read "0.0s").
        assert row.split()[-1] == "-", row


def test_drain_counts_every_copy_a_failed_generation_keeps(make_daemon: Any,
                                                           tmp_path: Path) -> None:
    # Found attacking: only shards in the failed state were counted. A generation that failed
    # with its shards still staged (its destination gone before any drained) left `drain
    # --wait` saying "nothing is left to drain; it is safe to stop", over 6 shards whose only
    # copy was on the node and that `ckptdrain retry` committed once the destination was back.
    root = tmp_path / "mnt" / "proj" / "ckpt"  # nothing mounted: no drain can start
    d: DaemonProcess = make_daemon(dest=root.as_uri(), CKPTDRAIN_DRAIN__RETRY_BUDGET_S="3")
    c = d.client()
    with c.generation("gone", 1) as gen:
        for i in range(6):
            gen.put(f"s{i}.bin", os.urandom(4096))
    with pytest.raises(GenerationFailed):
        c.wait("gone", 1, timeout_s=60)
    report = json.loads(cli(d, "drain", "--json").stdout)
    assert report["left"]["shards_failed"] == 6, report
    assert report["left"]["bytes_failed"] == 6 * 4096, report
    out = cli(d, "drain", "--wait", "--timeout", "30")
    assert "6 failed shard(s)" in out.stdout and "safe to stop" not in out.stdout, out.stdout
    # And the shard-state gauge says failed, not staged (a scheduler stuck, to the runbook).
    wait_for(lambda: scrape(d).get('ckptdrain_queue_shards{state="failed"}') == 6)
    assert scrape(d).get('ckptdrain_queue_shards{state="staged"}', 0) == 0
