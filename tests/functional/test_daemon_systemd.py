"""The daemon under systemd's protocols: socket activation (LISTEN_FDS), sd_notify
(READY after the socket is served, WATCHDOG at half WATCHDOG_USEC, STOPPING on SIGTERM) and
SIGHUP reloading limits. A real datagram socket stands in for systemd's notify socket."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from ckptdrain.client import Client, DaemonUnavailable
from tests.conftest import CKPTDRAIN, DaemonProcess, wait_for
from tests.functional.test_startup import scrape


def recv_until(sock: socket.socket, wanted: str, timeout_s: float = 30.0) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            msg = sock.recv(4096).decode()
        except TimeoutError:
            break
        seen.append(msg)
        if wanted in msg.splitlines():
            return seen
    raise AssertionError(f"{wanted!r} never arrived; got {seen}")


def notify_socket(directory: Path) -> tuple[socket.socket, str]:
    """A datagram socket standing in for systemd's notify socket, and its path."""
    path = directory / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    return sock, str(path)


def sighup_handled(pid: int) -> bool:
    """Whether process ``pid`` ignores or catches SIGHUP (its default ends the process)."""
    fields = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    bit = 1 << (signal.SIGHUP - 1)
    return bool((int(fields["SigIgn"], 16) | int(fields["SigCgt"], 16)) & bit)


def test_socket_activation_and_notify(tmp_path: Path, short_tmp: Path) -> None:
    notify_path = short_tmp / "notify"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    listen_path = short_tmp / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(listen_path))
    listener.listen(16)
    env = DaemonProcess(root=tmp_path, socket_path=short_tmp / "unused.sock",
                        dest_uri=f"file://{tmp_path / 'dest'}").env()
    env.update({"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "400000", "LISTEN_FDS": "1"})
    fd = listener.fileno()

    def as_fd3() -> None:
        os.dup2(fd, 3)

    # LISTEN_PID must be the daemon's own pid: the shell exports its pid, then execs it.
    # preexec_fn runs before the child closes fds, so fd 3 must be in pass_fds too.
    proc = subprocess.Popen(["sh", "-c", 'LISTEN_PID=$$ exec "$0" serve', CKPTDRAIN], env=env,
                            pass_fds=(3, fd), preexec_fn=as_fd3, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        listener.close()  # the daemon holds its copy
        first = recv_until(notify, "READY=1")
        # READY means served: a client gets an answer on the inherited socket right away.
        with Client(listen_path, timeout_s=10) as c:
            assert c.status()["node_id"] == "node-a"
        assert not (short_tmp / "unused.sock").exists(), "must not bind its own socket"
        pings = [m for m in recv_until(notify, "WATCHDOG=1") + recv_until(notify, "WATCHDOG=1")
                 if "WATCHDOG=1" in m.splitlines()]
        assert len(pings) >= 2
        assert any(line.startswith("STATUS=") for m in first for line in m.splitlines())
        proc.send_signal(signal.SIGTERM)
        recv_until(notify, "STOPPING=1")
        assert proc.wait(30) == 0
        assert listen_path.exists(), "an inherited socket belongs to systemd: not unlinked"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()


def test_sighup_reloads_limits_and_keeps_the_rest(make_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "ckptdrain.toml"
    config.write_text('[limits]\nmax_staged_bytes = "1GiB"\n')
    d: DaemonProcess = make_daemon(start=False, CKPTDRAIN_CONFIG=str(config))
    d.start()
    assert d.client().status()["limits"]["max_staged_bytes"] == 1 << 30
    config.write_text('[limits]\nmax_staged_bytes = "2GiB"\non_full = "reject"\n')
    os.kill(d.pid, signal.SIGHUP)
    deadline = time.monotonic() + 20
    while d.client().status()["limits"]["max_staged_bytes"] != 2 << 30:
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    assert d.client().status()["limits"]["on_full"] == "reject"
    # A broken config on reload is logged and ignored: the daemon keeps its limits.
    config.write_text("[limits]\nmax_staged_bytes = 'lots'\n")
    os.kill(d.pid, signal.SIGHUP)
    wait_for(lambda: "reload_failed" in d.log())
    assert d.client().status()["limits"]["max_staged_bytes"] == 2 << 30
    assert d.stop() == 0


def test_sigterm_does_not_wait_for_idle_clients(daemon: DaemonProcess) -> None:
    # A rank between two puts holds its connection open; stopping must not wait on it, and
    # the unfinished rank is aborted (its generation can never commit from this attempt).
    gen = daemon.client().generation("idle-at-stop", 1)
    gen.__enter__()
    gen.put("first", b"x")
    try:
        assert daemon.stop(timeout_s=8) == 0  # under the 10 s grace given to busy hand-offs
    finally:
        gen._channel.close()  # type: ignore[union-attr]
    daemon.start()
    [state] = daemon.client().status()["generations"]
    assert state["state"] == "failed"


def test_a_reload_whose_config_never_reads_keeps_the_daemon_serving(make_daemon, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                    short_tmp: Path) -> None:
    # Found attacking the operator's surface: SIGHUP read the config on the event loop. A
    # config that was a FIFO (or on a hung mount) froze every client and the stop until
    # something wrote to it. Then (attacking that fix) each such reload took one of the
    # hand-offs' threads for good: with io_threads reloads, every hand-off failed. A config
    # is read only as a regular file now, in a thread of its own, and the reload fails
    # alone; systemd hears READY=1 after each RELOADING=1.
    notify, notify_path = notify_socket(short_tmp)
    config = tmp_path / "ckptdrain.toml"
    config.write_text('[limits]\nmax_staged_bytes = "1GiB"\n')
    d: DaemonProcess = make_daemon(start=False, CKPTDRAIN_CONFIG=str(config),
                                   CKPTDRAIN_LIMITS__IO_THREADS="1",
                                   CKPTDRAIN_LIMITS__IO_TIMEOUT_S="1",
                                   NOTIFY_SOCKET=notify_path)
    d.start()
    try:
        recv_until(notify, "READY=1")
        config.unlink()
        os.mkfifo(config)
        for _ in range(3):
            os.kill(d.pid, signal.SIGHUP)
            recv_until(notify, "RELOADING=1")
            # Served meanwhile: the loop is not the one waiting on the FIFO.
            with d.client(timeout_s=5) as c:
                assert c.status()["limits"]["max_staged_bytes"] == 1 << 30
            recv_until(notify, "READY=1")
        wait_for(lambda: d.log().count("reload_failed") == 3)
        assert "is not a regular file" in d.log() and "Traceback" not in d.log()
        # The one io thread is free: a hand-off is staged.
        with d.client(timeout_s=10) as c, c.generation("after-fifo", 1) as gen:
            gen.put("a.bin", b"staged all the same")
        config.unlink()
        config.write_text('[limits]\nmax_staged_bytes = "2GiB"\n')
        os.kill(d.pid, signal.SIGHUP)
        wait_for(lambda: d.client().status()["limits"]["max_staged_bytes"] == 2 << 30)
    finally:
        notify.close()
    assert d.stop() == 0


def test_a_reload_asked_for_during_start_up_waits_for_it(make_daemon, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                          short_tmp: Path) -> None:
    # Found attacking the reload: a SIGHUP during start-up reloaded before the staging disk
    # was sampled (its clamp on max_staged_bytes undone) and sent READY=1 before the socket
    # was bound; one before the handler existed, or during the stop, ended the process by
    # SIGHUP. A reload now waits until the daemon is ready, and SIGHUP is ignored outside.
    notify, notify_path = notify_socket(short_tmp)
    config = tmp_path / "ckptdrain.toml"
    config.write_text('[limits]\nmax_staged_bytes = "800TiB"\n')  # clamped to the disk
    d: DaemonProcess = make_daemon(start=False, CKPTDRAIN_CONFIG=str(config),
                                   NOTIFY_SOCKET=notify_path)
    try:
        d.start()
        assert d.proc is not None
        assert d.client().status()["limits"]["max_staged_bytes"] < 800 << 40
        d.stop()
        recv_until(notify, "STOPPING=1")  # what the first run said
        proc = subprocess.Popen([CKPTDRAIN, "serve"], env=d.env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            # A storm from the moment `serve` looks after SIGHUP (the interpreter's own start
            # and imports come before: nothing can).
            wait_for(lambda: sighup_handled(proc.pid))
            for _ in range(50):
                os.kill(proc.pid, signal.SIGHUP)
            first = recv_until(notify, "READY=1")
            # The first READY=1 is the start-up's: the socket is there, no reload came first.
            assert d.socket_path.exists() and not any("RELOADING=1" in m for m in first), first
            with Client(d.socket_path, timeout_s=10) as c:
                # Still clamped to the disk (the file's 800 TiB was not applied unclamped).
                assert c.status()["limits"]["max_staged_bytes"] < 800 << 40
            # A storm through the stop, to the process's exit: it ends as stopped (0).
            def storm() -> None:
                while proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGHUP)
                    time.sleep(0.001)

            storming = threading.Thread(target=storm)
            storming.start()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
            storming.join(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        notify.close()


def test_status_and_the_metrics_say_a_reload_failed_or_waits_for_a_restart(  # type: ignore[no-untyped-def]
        make_daemon, tmp_path: Path) -> None:
    # Found attacking: a failed reload, or a changed key only a restart applies (the
    # destination), was in the log alone; `status` and the metrics said nothing, and `config
    # show` printed the file's new destination while the daemon drained to the old one.
    config = tmp_path / "ckptdrain.toml"
    config.write_text('[limits]\nmax_staged_bytes = "1GiB"\n')
    d: DaemonProcess = make_daemon(start=False, CKPTDRAIN_CONFIG=str(config))
    d.start()
    assert d.client().status()["config"] == {"reload_failed": None, "needs_restart": []}
    config.write_text("[limits]\nmax_staged_bytes = 'lots'\n")
    os.kill(d.pid, signal.SIGHUP)
    wait_for(lambda: d.client().status()["config"]["reload_failed"])
    wait_for(lambda: scrape(d).get("ckptdrain_config_reload_failed") == 1)
    # The CLI finds the socket through the config, which does not load: it says how else.
    out = subprocess.run([CKPTDRAIN, "status"], env=d.env(), capture_output=True, text=True,
                         check=False)
    assert out.returncode == 78 and "name its socket: --socket PATH" in out.stderr, out.stderr
    out = subprocess.run([CKPTDRAIN, "status", "--socket", str(d.socket_path)], env=d.env(),
                         capture_output=True, text=True, check=False)
    assert "CONFIG RELOAD FAILED, the old config runs on" in out.stdout, out.stdout
    config.write_text('[limits]\nmax_staged_bytes = "1GiB"\n[destination]\nmax_concurrency = 3\n')
    os.kill(d.pid, signal.SIGHUP)
    wait_for(lambda: d.client().status()["config"]["reload_failed"] is None)
    assert d.client().status()["config"]["needs_restart"] == ["destination.max_concurrency"]
    wait_for(lambda: scrape(d).get("ckptdrain_config_needs_restart_keys") == 1)
    wait_for(lambda: scrape(d).get("ckptdrain_config_reload_failed") == 0)


def _activated(listener: socket.socket, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``ckptdrain serve`` on ``listener`` as systemd's socket unit starts it (LISTEN_FDS)."""
    fd = listener.fileno()
    env = {**env, "LISTEN_FDS": "1"}
    return subprocess.Popen(["sh", "-c", 'LISTEN_PID=$$ exec "$0" serve', CKPTDRAIN], env=env,
                            pass_fds=(3, fd), preexec_fn=lambda: os.dup2(fd, 3),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_a_wait_across_a_restart_of_a_socket_activated_daemon_gets_the_step_end(
        tmp_path: Path, short_tmp: Path) -> None:
    # Found attacking: `systemctl restart ckptdrain` (its socket unit holding the socket)
    # during a job's wait(timeout_s=60) raised DaemonUnavailable at once, though the step
    # survived the restart and committed seconds later.
    listen_path = short_tmp / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # what systemd holds
    listener.bind(str(listen_path))
    listener.listen(16)
    env = DaemonProcess(root=tmp_path, socket_path=short_tmp / "unused.sock",
                        dest_uri=f"file://{tmp_path / 'dest'}").env()
    daemons = [_activated(listener, env)]
    try:
        client = Client(listen_path, timeout_s=30)
        assert client.status()["generations"] == []  # served; its connection is pooled
        with client.generation("job", 1, rank=0, world_size=2) as gen:
            gen.put("r0", b"rank 0")  # rank 1 saves after the restart: the step waits for it
        [pooled] = client._idle  # the first daemon's connection: the wait goes on it
        sent = threading.Event()
        read_reply = pooled._read_reply

        def reply_after_the_request_went(deadline: float) -> Any:
            sent.set()
            return read_reply(deadline)

        pooled._read_reply = reply_after_the_request_went  # type: ignore[method-assign]
        answers: list[object] = []

        def wait() -> None:
            try:
                answers.append(client.wait("job", 1, timeout_s=60))
            except Exception as exc:  # the assertion below shows it
                answers.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        assert sent.wait(30)
        daemons[0].send_signal(signal.SIGTERM)
        assert daemons[0].wait(30) == 0
        daemons.append(_activated(listener, env))
        with Client(listen_path, timeout_s=30).generation("job", 1, rank=1, world_size=2) as gen:
            gen.put("r1", b"rank 1")
        waiter.join(60)
        [answer] = answers
        assert isinstance(answer, dict) and answer["committed"], answer
    finally:
        for proc in daemons:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
        listener.close()


def test_a_wait_whose_daemon_dies_for_good_still_raises_at_once(daemon: DaemonProcess) -> None:
    # The wait asks again only a daemon it can reach: with none behind the socket it raises
    # DaemonUnavailable at once, not after its timeout_s.
    client = daemon.client(timeout_s=30)
    assert client.status()["generations"] == []
    with client.generation("job", 1, rank=0, world_size=2) as gen:
        gen.put("r0", b"rank 0")
    [pooled] = client._idle
    sent = threading.Event()
    read_reply = pooled._read_reply

    def reply_after_the_request_went(deadline: float) -> Any:
        sent.set()
        return read_reply(deadline)

    pooled._read_reply = reply_after_the_request_went  # type: ignore[method-assign]
    answers: list[tuple[object, float]] = []

    def wait() -> None:
        started = time.monotonic()
        try:
            answers.append((client.wait("job", 1, timeout_s=600), 0.0))
        except Exception as exc:  # the assertion below shows it
            answers.append((exc, time.monotonic() - started))

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert sent.wait(30)
    daemon.kill()
    waiter.join(60)
    [(answer, took_s)] = answers
    assert isinstance(answer, DaemonUnavailable) and took_s < 10, (answer, took_s)


def test_a_reload_while_the_staging_disk_is_full_for_now_applies(make_daemon,  # type: ignore[no-untyped-def]
                                                                 tmp_path: Path) -> None:
    # Found attacking the reload: with the staging filesystem filled by someone else (under
    # 16 MiB free), every SIGHUP failed with "the filesystem ... has N bytes usable, under the
    # 16777216 bytes a checkpoint needs; free space there or move staging_dir to a larger
    # disk", and kept the old limits: in the incident where an operator reloads to change
    # on_full or the drain's pace, and CkptdrainConfigNotApplied fired on top. A start-up on
    # such a disk already went on (full for now, not too small); a reload does the same.
    from tests.conftest import fill_up
    from tests.functional.test_startup import small_filesystem

    config = tmp_path / "ckptdrain.toml"
    config.write_text('[limits]\nmax_staged_bytes = "1GiB"\n')
    d: DaemonProcess = make_daemon(start=False, CKPTDRAIN_CONFIG=str(config))
    with small_filesystem(d.staging, 64):
        d.start()
        limit = d.client().status()["limits"]["max_staged_bytes"]
        assert 32 << 20 <= limit < 64 << 20, limit
        fill_up(d.staging)
        wait_for(lambda: d.client().status()["staging_free_bytes"] < 16 << 20)
        config.write_text('[limits]\nmax_staged_bytes = "1GiB"\non_full = "reject"\n')
        os.kill(d.pid, signal.SIGHUP)
        wait_for(lambda: "event=reload" in d.log())
        status = d.client().status()
        assert status["config"]["reload_failed"] is None, status["config"]
        assert status["limits"]["on_full"] == "reject"
        # The disk's size still bounds the limit; a full disk does not shrink it for good.
        assert status["limits"]["max_staged_bytes"] == limit
        (d.staging / "filler").unlink()
        assert d.stop() == 0


def test_a_reload_the_running_config_cannot_take_says_why_and_what_waits_for_a_restart(  # type: ignore[no-untyped-def]
        make_daemon, tmp_path: Path) -> None:
    # Found attacking the reload: a file that switched ack from "memory" to "local" and set
    # max_memory_bytes to 0 (valid: `config check` says OK) failed the reload with 'ack:
    # "memory" needs a RAM tier, but limits.max_memory_bytes is 0; raise it or use ack =
    # "local"' (which the file already did), and `status` named no key waiting for a restart.
    # The limit cannot go to 0 under the running ack, so the reload still fails; but it says
    # that the running ack is the start's, and names ack as waiting for a restart.
    config = tmp_path / "ckptdrain.toml"
    config.write_text('ack = "memory"\n[limits]\nmax_memory_bytes = "1GiB"\n')
    d: DaemonProcess = make_daemon(start=False, CKPTDRAIN_CONFIG=str(config))
    d.start()
    config.write_text('ack = "local"\n[limits]\nmax_memory_bytes = 0\n')
    os.kill(d.pid, signal.SIGHUP)
    wait_for(lambda: d.client().status()["config"]["reload_failed"])
    state = d.client().status()["config"]
    assert "ack" in state["needs_restart"], state
    failed = state["reload_failed"]
    assert "restart" in failed and "use ack = \"local\"" not in failed, failed
    assert d.client().status()["limits"]["max_memory_bytes"] == 1 << 30
    wait_for(lambda: scrape(d)["ckptdrain_config_needs_restart_keys"] >= 1)
