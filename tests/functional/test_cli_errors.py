"""The CLI's one error boundary: every ordinary mistake is one line naming the cause and the
fix, with the right exit code (0 ok, 1 failed, 2 usage, 78 configuration or environment), and
never a traceback. Each case is the real ``ckptdrain`` in a subprocess."""

from __future__ import annotations

import argparse
import contextlib
import http.server
import io
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import CKPTDRAIN, DaemonProcess

JOB = "cli-errors"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon with two committed generations of JOB: 1 intact, 2 with a damaged shard."""
    root = tmp_path_factory.mktemp("cli")
    sock_dir = Path(tempfile.mkdtemp(prefix="ckd-", dir="/tmp"))  # sun_path is short
    d = DaemonProcess(root=root, socket_path=sock_dir / "node.sock",
                      dest_uri=f"file://{root / 'dest'}")
    d.start()
    try:
        for step in (1, 2):
            with d.client().generation(JOB, step) as gen:
                gen.put("a/b/w.bin", os.urandom(4096))
                gen.put("z/y.bin", os.urandom(4096))
            d.client().wait(JOB, step, timeout_s=60)
        victim = d.dest / JOB / f"{2:020d}" / "z" / "y.bin"
        victim.write_bytes(b"short")
        yield d
    finally:
        d.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


def cli(node: DaemonProcess, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**node.env(), **env}
    return subprocess.run([CKPTDRAIN, *args], env=full, capture_output=True, text=True,
                          timeout=120, check=False)


def one_sentence(out: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """The command exited ``code`` with exactly one line on stderr, naming every needle."""
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptdrain: "), out.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_generation_that_is_not_committed(node: DaemonProcess, tmp_path: Path) -> None:
    one_sentence(cli(node, "verify", node.dest_uri, "--job", JOB, "--generation", "999"), 1,
                 "999", "not committed", "ckptdrain ls")
    to = tmp_path / "never"
    one_sentence(cli(node, "restore", node.dest_uri, "--job", JOB, "--generation", "999",
                     "--to", str(to)), 1, "not committed")
    assert not to.exists()
    one_sentence(cli(node, "verify", node.dest_uri, "--job", JOB, "--generation", "two"), 2,
                 "--generation", "'latest'")
    # Found attacking restore: a step past 2**63 - 1 was a traceback, exit 1.
    for extra in ([], ["--to", str(to)]):
        command = "restore" if extra else "verify"
        one_sentence(cli(node, command, node.dest_uri, "--job", JOB, "--generation",
                         str(2**63), *extra), 2, "--generation", str(2**63 - 1))
    # The directories' zero-padded form is a step all the same (found attacking the bound).
    for zeros in (19, 4400):  # (4,400: past what int() takes; a traceback, found attacking)
        padded = cli(node, "verify", node.dest_uri, "--job", JOB, "--generation",
                     "0" * zeros + "1")
        assert padded.returncode == 0 and "generation 1 " in padded.stdout, padded.stderr
    assert not to.exists()


def test_restore_from_a_damaged_destination_leaves_nothing_behind(node: DaemonProcess,
                                                                  tmp_path: Path) -> None:
    to = tmp_path / "new" / "deep"
    one_sentence(cli(node, "restore", node.dest_uri, "--job", JOB, "--generation", "2",
                     "--to", str(to), "--no-local"), 1, "z/y.bin", "damaged")
    assert not (tmp_path / "new").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    one_sentence(cli(node, "restore", node.dest_uri, "--job", JOB, "--generation", "2",
                     "--to", str(empty), "--no-local"), 1, "damaged")
    assert empty.is_dir() and not list(empty.iterdir())


@pytest.mark.parametrize(("command", "job", "needle"), [
    ("ls", "../etc", "'/'"),
    ("verify", "bad job", "' '"),
    ("gc", "-rf", "'-'"),
])
def test_bad_job_names_are_usage_errors(node: DaemonProcess, command: str, job: str,
                                        needle: str) -> None:
    one_sentence(cli(node, command, node.dest_uri, f"--job={job}"), 2, "--job", needle,
                 f"ckptdrain {command} --help")


def test_a_bad_job_name_to_status_is_a_usage_error_too(node: DaemonProcess) -> None:
    # Found attacking the CLI: `status --job 'bad job'` exited 1 (a failure) where every other
    # command says 2 (usage) for the same mistake.
    one_sentence(cli(node, "status", "--socket", str(node.socket_path), "--job=bad job"), 2,
                 "--job", "' '", "ckptdrain status --help")


def test_restore_target_checks(node: DaemonProcess, tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    one_sentence(cli(node, "restore", node.dest_uri, "--job", JOB, "--generation", "1",
                     "--to", str(a_file)), 1, str(a_file), "not a directory")
    assert a_file.read_text() == "mine"
    full = tmp_path / "full"
    full.mkdir()
    (full / "theirs.txt").write_text("keep")
    one_sentence(cli(node, "restore", node.dest_uri, "--job", JOB, "--generation", "1",
                     "--to", str(full)), 1, "not empty", "--overwrite")
    assert sorted(p.name for p in full.iterdir()) == ["theirs.txt"]
    out = cli(node, "restore", node.dest_uri, "--job", JOB, "--generation", "1",
              "--to", str(full), "--overwrite")
    assert out.returncode == 0, out.stderr
    assert (full / "theirs.txt").read_text() == "keep" and (full / "a" / "b" / "w.bin").exists()


def test_a_restore_into_the_destination_is_refused(node: DaemonProcess, tmp_path: Path) -> None:
    # Found attacking restore: `--to <a generation directory> --overwrite` removed that
    # committed generation's MANIFEST.json first; stopped or failing, it left the step
    # uncommitted, and gc then removed it as abandoned. A --to that is the destination root
    # or inside it (by a link too) is refused before anything is touched, and so is a
    # restore into a directory holding the destination where a shard would land in it.
    generation = node.dest / JOB / f"{1:020d}"
    alias = tmp_path / "alias"
    alias.symlink_to(generation)
    before = sorted(p.relative_to(node.dest) for p in node.dest.rglob("*"))
    for to in (generation, node.dest, node.dest / "new" / "dir", alias, alias / "a"):
        one_sentence(cli(node, "restore", node.dest_uri, "--job", JOB, "--generation", "1",
                         "--to", str(to), "--overwrite", "--no-local"), 1,
                     str(to), "inside the destination", "restore elsewhere")
    assert sorted(p.relative_to(node.dest) for p in node.dest.rglob("*")) == before
    assert cli(node, "verify", node.dest_uri, "--job", JOB, "--generation", "1").returncode == 0
    # A destination at z/ of --to: shard z/y.bin would land in it.
    holder = tmp_path / "holder"
    shutil.copytree(node.dest, holder / "z", symlinks=True)
    one_sentence(cli(node, "restore", f"file://{holder / 'z'}", "--job", JOB, "--generation",
                     "1", "--to", str(holder), "--overwrite", "--no-local"), 1,
                 str(holder / "z"), "inside the destination", "restore elsewhere")
    assert not (holder / "z" / "y.bin").exists() and not (holder / "a").exists()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a bind mount needs root (CI runs as root) and unshare")
def test_a_restore_into_a_bind_mount_of_the_destination_is_refused(
        daemon: DaemonProcess, tmp_path: Path) -> None:
    # Found attacking restore: with the destination bind-mounted at z/ of an --overwrite
    # target, whose path names no destination, the shard z/<job>/<step>/w.bin of one job
    # replaced another job's committed shard ("checksums verified"; its verify then failed).
    # The destination is known by identity as restore walks the target's directories. The
    # mount is made in a mount namespace of the command's own, gone with it.
    c = daemon.client()
    with c.generation("victim", 1) as gen:
        gen.put("w.bin", b"the committed shard")
    with c.generation("binder", 1) as gen:
        gen.put(f"z/victim/{1:020d}/w.bin", b"not the committed shard")
        gen.put("other.bin", b"x")
    for job in ("victim", "binder"):
        c.wait(job, 1, timeout_s=60)
    holder = tmp_path / "holder"
    (holder / "z").mkdir(parents=True)
    (holder / "notes.txt").write_text("mine")
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount --bind "$1" "$2" && exec "$3" restore "$4" --job binder --to "$5" --overwrite '
         "--no-local", "sh", str(daemon.dest), str(holder / "z"), CKPTDRAIN, daemon.dest_uri,
         str(holder)], env=daemon.env(), capture_output=True, text=True, timeout=120,
        check=False)
    one_sentence(out, 1, str(holder / "z"), "inside the destination", "restore elsewhere")
    assert cli(daemon, "verify", daemon.dest_uri, "--job", "victim").returncode == 0
    assert sorted(p.name for p in holder.iterdir()) == ["notes.txt", "z"]
    assert list((holder / "z").iterdir()) == []  # (the mount went with its namespace)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="a root without its file capabilities needs root and setpriv")
def test_a_shard_the_user_may_not_read_says_who_needs_access(node: DaemonProcess,
                                                             tmp_path: Path) -> None:
    # Found attacking restore: a shard the restoring user may not read failed "permission
    # denied ...; let the daemon's user write there", neither the user nor the access that
    # was refused. It names the user the command runs as (here root without
    # CAP_DAC_OVERRIDE, whom a file of another owner's with mode 000 refuses).
    dest = tmp_path / "dest"
    shutil.copytree(node.dest, dest, symlinks=True)
    shard = dest / JOB / f"{1:020d}" / "z" / "y.bin"
    os.chown(shard, 65534, 65534)
    shard.chmod(0)
    caps = "-dac_override,-dac_read_search"
    for command in ("restore", "verify"):
        out = subprocess.run(
            ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", "--", CKPTDRAIN,
             command, f"file://{dest}", "--job", JOB, "--generation", "1",
             *(["--to", str(tmp_path / "r"), "--no-local"] if command == "restore" else [])],
            env=node.env(), capture_output=True, text=True, timeout=120, check=False)
        line = one_sentence(out, 1, "z/y.bin", "permission denied", "user 'root' (uid 0)",
                            "have access there")
        assert "daemon's user" not in line
    assert not (tmp_path / "r").exists()


def test_a_servers_message_stays_on_the_one_line_of_the_failure(node: DaemonProcess) -> None:
    # Found attacking the destination commands: an S3 server's error message with a newline
    # and a right-to-left override in it came out as two lines, the second drawn backwards.
    # A real HTTP server on loopback answers every request so.
    body = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
            "<Message>line one\nline two \u202eDENIED\u202c end</Message></Error>").encode()

    class Refuse(http.server.BaseHTTPRequestHandler):
        def answer(self) -> None:
            self.send_response(403)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        out = cli(node, "verify", "s3://bucket/prefix", "--job", JOB,
                  CKPTDRAIN_DESTINATION__ENDPOINT_URL=f"http://127.0.0.1:{server.server_port}",
                  CKPTDRAIN_DESTINATION__MAX_ATTEMPTS="1", AWS_ACCESS_KEY_ID="k",
                  AWS_SECRET_ACCESS_KEY="s")
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    line = one_sentence(out, 1, "AccessDenied", "line one\\nline two \\u202eDENIED", "end")
    assert "\u202e" not in line


def test_a_directory_chain_deeper_than_any_key_is_passed_over(node: DaemonProcess,
                                                              tmp_path: Path) -> None:
    # Found attacking gc: a directory chain 1,500 levels deep planted in a generation made
    # the listing of it (os.fwalk, recursive) raise RecursionError: a traceback from `verify`
    # and from `gc` (and from the daemon's retention and temp sweep) on every run. Nothing
    # deeper than a shard path can go is a key of ours: it is not walked.
    dest = tmp_path / "dest"
    shutil.copytree(node.dest, dest, symlinks=True)
    top = dest / JOB / f"{1:020d}"
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(1500):
            os.mkdir("q", dir_fd=fd)
            deeper = os.open("q", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = deeper
    finally:
        os.close(fd)
    try:
        out = cli(node, "verify", f"file://{dest}", "--job", JOB, "--generation", "1")
        assert out.returncode == 0 and "2 shards" in out.stdout, out.stderr[-2000:]
        out = cli(node, "gc", f"file://{dest}", "--job", JOB, "--keep-last", "2", "--dry-run")
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    finally:
        # One level at a time from the top: the fixture's rmtree recurses once per level too.
        while (top / "q").exists():
            if (top / "q" / "q").exists():
                os.rename(top / "q" / "q", top / "r")
                os.rmdir(top / "q")
                os.rename(top / "r", top / "q")
            else:
                os.rmdir(top / "q")


def test_an_empty_to_is_a_usage_error(node: DaemonProcess, tmp_path: Path) -> None:
    # Found attacking restore: `--to ""` (an unset variable in a script, --to "$DIR")
    # restored into the current directory, with --overwrite over what was there.
    (tmp_path / "notes.txt").write_text("mine")
    for extra in ((), ("--overwrite",)):
        one_sentence(subprocess.run(
            [CKPTDRAIN, "restore", node.dest_uri, "--job", JOB, "--generation", "1", "--to", "",
             "--no-local", *extra], env=node.env(), cwd=tmp_path, capture_output=True,
            text=True, timeout=120), 2, "--to", "empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("argv", [["status", "--config", ""], ["status", "--socket", ""],
                                  ["config", "check", "--config", ""], ["serve", "--config", ""],
                                  ["drain", "--socket", ""], ["retry", "j", "1", "--socket", ""]])
def test_an_empty_config_or_socket_is_a_usage_error(node: DaemonProcess, argv: list[str]) -> None:
    # Found as a new operator: `--config "$CONF"` with CONF unset read the current directory
    # ("is a directory, not a config file", exit 78), and `--socket ""` a daemon at "."
    # ("nothing is listening on it; start it", exit 1): neither named the empty argument.
    one_sentence(cli(node, *argv), 2, "--config" if "--config" in argv else "--socket",
                 "empty string", "unset variable")
    assert node.client().status()["draining"] is False  # drain was never sent


def test_status_of_a_job_the_node_does_not_hold_names_the_job(node: DaemonProcess) -> None:
    # Found as a new operator: `status --job typo` said "no generations on this node" on a
    # node that held generations of another job.
    out = cli(node, "status", "--job", "no-such-job")
    assert out.returncode == 0 and not out.stderr, out
    assert "no generations of job 'no-such-job' on this node" in out.stdout, out.stdout
    assert "no generations on this node" not in out.stdout
    listed = cli(node, "status")
    assert JOB in listed.stdout, listed.stdout


def test_status_of_a_user_who_owns_nothing_here_says_it_is_filtered(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found as a new user: on a node busy with root's job, another user's `ckptdrain status`
    # said "no generations on this node". The CLI runs in a child as that user (its
    # interpreter may be out of that user's reach, so not a new process).
    from ckptdrain.daemon import cli as cli_module
    from tests.functional.otheruser import run_as

    d: DaemonProcess = make_daemon(CKPTDRAIN_ACCESS__SOCKET_MODE="0666",
                                   CKPTDRAIN_ACCESS__ALLOWED_UIDS="[65534]")
    os.chmod(d.socket_path.parent, 0o755)
    with d.client().generation("roots-job", 1, rank=0, world_size=2) as gen:
        gen.put("w", b"held")

    cli_module.build_parser()  # imports what the command needs while root may read it

    def status(*argv: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = cli_module.main(["status", "--socket", str(d.socket_path), *argv])
        return f"{code} {out.getvalue().splitlines()[-1]}"

    for argv, what in (((), "no generations"), (("--job", "roots-job"), "no generations of job "
                                                "'roots-job'")):
        assert run_as(65534, lambda argv=argv: status(*argv)) == (
            f"0 {what} on this node that uid 65534 may see (a user sees the jobs it owns; root "
            "sees every one)")
    assert "roots-job" in status()
    # The daemon's own user sees every job: a per-user daemon, whose socket is the user's.
    from ckptdrain.daemon.cli_node import _nothing_listed

    own = d.socket_path.parent / "own.sock"  # where the user may look
    own.touch()
    os.chown(own, 65534, 65534)
    assert run_as(65534, lambda: _nothing_listed(None, str(own))) == "no generations on this node"


def test_another_users_refusals_name_what_was_refused(make_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Found as a new user: `ckptdrain restore` of another user's job said the daemon "did not
    # serve a local copy (... uid 65534 may not write it)": a read, refused as a write.
    from ckptdrain.client import Client, PermissionDenied
    from tests.functional.otheruser import run_as

    d: DaemonProcess = make_daemon(CKPTDRAIN_ACCESS__SOCKET_MODE="0666",
                                   CKPTDRAIN_ACCESS__ALLOWED_UIDS="[65534]")
    os.chmod(d.socket_path.parent, 0o755)
    with d.client().generation("roots-job", 1, rank=0, world_size=1) as gen:
        gen.put("w", b"held")
    d.client().wait("roots-job", 1, timeout_s=60)
    out = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT, 0o600)  # the child's too

    def refusals() -> str:
        c = Client(d.socket_path, timeout_s=20)
        said = []
        for call in (lambda: c.open_local("roots-job", 1, "w"),
                     lambda: c.fetch_local("roots-job", 1, "w", out),
                     lambda: c.fetch_from_destination("roots-job", 1, "w", out),
                     lambda: c.retry("roots-job", 1),
                     lambda: c.abort_generation("roots-job", 1),
                     c.drain):
            try:
                call()
                said.append("SERVED")
            except PermissionDenied as exc:
                said.append(str(exc).split("uid 65534 ", 1)[-1])
        return " | ".join(said)

    reading = "may not read it through this daemon"
    try:
        # (drain said "run the command as root or as uid 0" of a daemon run as root)
        assert run_as(65534, refusals) == " | ".join(
            [reading] * 3 + ["may not retry it", "may not abort it",
                             "may not drain or resume this node; run the command as root"])
    finally:
        os.close(out)


def test_a_retry_or_abort_of_a_step_the_node_does_not_hold_says_where_to_look(
        node: DaemonProcess) -> None:
    # Found as a new operator: abort said "`ckptdrain status` lists what it holds", retry
    # only "this node holds no step 999" (typically run on the wrong node).
    for command in ("retry", "abort"):
        one_sentence(cli(node, command, JOB, "999"), 1, "holds no step 999",
                     "`ckptdrain status` lists what it holds")


def test_the_documented_log_line_is_the_daemons(node: DaemonProcess) -> None:
    # Found as a new operator: configuration.md's example of a log line lacked the
    # `outcome=` the daemon writes between the step and the shard count.
    docs = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    [documented] = [ln for ln in docs.splitlines() if "event=generation_committed" in ln]
    logged = next(ln for ln in node.log().splitlines() if "event=generation_committed" in ln)

    def keys(line: str) -> list[str]:
        return [part.split("=", 1)[0] for part in line.split() if "=" in part]

    assert keys(documented) == keys(logged), (documented, logged)


def test_ls_names_the_time_zone_and_keeps_long_names_in_line(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found as a new operator: COMMITTED was a bare local time (read one way on the node, another
    # on a laptop in another zone), and a job name past 20 characters pushed its row out of line.
    node: DaemonProcess = make_daemon()
    long_job = "a-job-name-well-past-twenty-characters"
    for job in (long_job, "short"):
        with node.client().generation(job, 7) as gen:
            gen.put("w.bin", b"w")
        node.client().wait(job, 7, timeout_s=60)
    out = cli(node, "ls", node.dest_uri, TZ="JST-9")
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert all(row.endswith(" JST") for row in rows), rows
    assert all(len(row) == len(rows[0]) for row in rows), rows  # one width for every row
    assert header.index("COMMITTED") == rows[0].index("20")  # the times start under it
    [mine] = [json.loads(cli(node, "ls", node.dest_uri, "--json", "--job", long_job).stdout)[0]]
    expected = time.strftime("%Y-%m-%d %H:%M", time.gmtime(mine["committed_at"] + 9 * 3600))
    assert any(row.startswith(long_job) and expected in row for row in rows), (expected, rows)


def test_every_argument_of_every_command_says_what_it_is() -> None:
    # Found as a new operator: `ckptdrain restore --help` listed --job, DEST and --quiet with
    # nothing beside them; so did ls, verify, retry and abort for some of theirs.
    from ckptdrain.daemon.cli import build_parser

    bare = []

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    walk(child, f"{name} {sub}")
            elif not isinstance(action, argparse._HelpAction) and not action.help:
                bare.append(f"{name} {action.option_strings or action.dest}")

    walk(build_parser(), "ckptdrain")
    assert bare == []


@pytest.mark.parametrize("readers", ["-1", "65", "two", ""])
def test_a_bad_readers_count_is_a_usage_error(node: DaemonProcess, readers: str,
                                              tmp_path: Path) -> None:
    one_sentence(cli(node, "restore", node.dest_uri, "--job", JOB, "--to", str(tmp_path / "r"),
                     f"--readers={readers}"), 2, "--readers", "0 to 64")
    assert not (tmp_path / "r").exists()


def test_a_bare_path_or_a_bad_uri_as_dest(node: DaemonProcess) -> None:
    line = one_sentence(cli(node, "ls", str(node.dest)), 2, "is a path", f"file://{node.dest}")
    assert "pydantic" not in line
    one_sentence(cli(node, "verify", "ftp://host/x", "--job", JOB), 2, "not a supported destination")


@pytest.mark.parametrize("command", ["ls", "gc"])
def test_a_destination_that_does_not_exist_is_an_error(node: DaemonProcess, command: str,
                                                       tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dest"
    one_sentence(cli(node, command, f"file://{missing}"), 1, "does not exist", str(missing))
    assert not missing.exists()


@pytest.mark.parametrize("command", ["ls", "gc"])
@pytest.mark.parametrize("holds", ["generations", "LATEST"])
def test_a_job_directory_given_as_the_destination_is_named_as_such(
    node: DaemonProcess, command: str, holds: str, tmp_path: Path
) -> None:
    # Found attacking the CLI: `ls file://$D/j1` and `gc file://$D/j1` (a job's directory as
    # DEST, one level too deep) exited 0 saying nothing, as for an empty destination.
    if holds == "generations":
        job_dir = node.dest / JOB
    else:
        job_dir = tmp_path / "dest" / "j1"
        job_dir.mkdir(parents=True)
        (job_dir / "LATEST").write_text("1\n")
    before = sorted(p.name for p in job_dir.iterdir())
    extra = ["--dry-run"] if command == "gc" else []
    one_sentence(cli(node, command, f"file://{job_dir}", *extra), 1, "job's directory",
                 f"file://{job_dir.parent}", f"--job {job_dir.name}")
    assert sorted(p.name for p in job_dir.iterdir()) == before


@pytest.mark.parametrize("command", ["ls", "gc"])
def test_a_job_with_nothing_at_the_destination_is_named_as_such(
    node: DaemonProcess, command: str
) -> None:
    # Found attacking the CLI: `gc --job jl` (a typo'd job name) exited 0 saying nothing
    # done, where `restore --job` and `verify --job` say the job has nothing there (exit 1).
    extra = ["--dry-run"] if command == "gc" else []
    one_sentence(cli(node, command, node.dest_uri, "--job", "cli-errorz", *extra), 1,
                 "'cli-errorz'", "no job", "ckptdrain ls")
    listed = cli(node, command, node.dest_uri, "--job", JOB, *extra)
    assert listed.returncode == 0 and JOB in listed.stdout, listed.stderr


def test_a_closed_pipe_exits_quietly(node: DaemonProcess) -> None:
    # The reader is gone before the first write (what `status | head -2` races into): the
    # command exits 0 with nothing on stderr, every time.
    for _ in range(3):
        proc = subprocess.Popen([CKPTDRAIN, "status"], env=node.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        err = proc.stderr.read()
        proc.stderr.close()
        assert proc.wait(60) == 0, err
        assert err == b""


def test_no_daemon_is_one_sentence(node: DaemonProcess, tmp_path: Path) -> None:
    one_sentence(cli(node, "status", "--socket", str(tmp_path / "nobody.sock")), 1,
                 "cannot reach", "ckptdrain serve")


# -- --json for automation ----------------------------------------------------------------------
def _shape(doc: object, schema: dict[str, type | tuple[type, ...]]) -> None:
    assert isinstance(doc, dict), doc
    assert set(doc) == set(schema), sorted(doc)
    for key, kind in schema.items():
        assert isinstance(doc[key], kind), (key, doc[key])


def test_json_output_schemas(node: DaemonProcess, tmp_path: Path) -> None:
    out = cli(node, "ls", node.dest_uri, "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["generation"] for r in rows] == [2, 1]
    for row in rows:
        _shape(row, {"job": str, "generation": int, "shards": int, "bytes": int,
                     "committed_at": (int, float), "nodes": list})

    out = cli(node, "verify", node.dest_uri, "--job", JOB, "--generation", "1", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    _shape(doc, {"job": str, "generation": int, "ok": bool, "checked": int, "bytes": int,
                 "stored": int, "bad": list})
    assert doc["ok"] is True and doc["checked"] == 2
    out = cli(node, "verify", node.dest_uri, "--job", JOB, "--generation", "2", "--json")
    assert out.returncode == 1
    doc = json.loads(out.stdout)
    assert doc["ok"] is False and [b["path"] for b in doc["bad"]] == ["z/y.bin"]
    for bad in doc["bad"]:
        _shape(bad, {"path": str, "reason": str})

    out = cli(node, "restore", node.dest_uri, "--job", JOB, "--generation", "1",
              "--to", str(tmp_path / "r"), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    _shape(doc, {"job": str, "generation": int, "to": str, "files": int, "bytes": int,
                 "local_files": int, "local_rejected": int})
    assert doc["files"] == 2 and doc["bytes"] == 8192

    out = cli(node, "gc", node.dest_uri, "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    (report,) = json.loads(out.stdout)
    _shape(report, {"job": str, "dry_run": bool, "keep_last": int, "abandoned_grace_s": float,
                    "kept": list, "deleted": list, "abandoned_deleted": list, "skipped": list,
                    "failed": list})

    out = cli(node, "status", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    for key, kind in {"node_id": str, "ack": str, "destination": str, "staged_bytes": int,
                      "queued_shards": int, "generations": list, "limits": dict}.items():
        assert isinstance(doc[key], kind), (key, doc.get(key))
    for gen in doc["generations"]:
        for key, kind in {"job": str, "step": int, "state": str, "ranks": (list, dict),
                          "shards": dict, "bytes": dict}.items():
            assert isinstance(gen[key], kind), (key, gen.get(key))


def test_a_manifest_nested_too_deeply_is_skipped(node: DaemonProcess, tmp_path: Path) -> None:
    # Found attacking the read side: a MANIFEST.json of arrays nested 100,000 deep made
    # ls, verify, restore and gc print a RecursionError traceback.
    hostile = node.dest / JOB / f"{7:020d}"
    hostile.mkdir()
    try:
        (hostile / "MANIFEST.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
        out = cli(node, "ls", node.dest_uri, "--job", JOB)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        assert "7" not in out.stdout.split() and "2" in out.stdout.split(), out.stdout
        out = cli(node, "restore", node.dest_uri, "--job", JOB, "--generation", "7",
                  "--to", str(tmp_path / "r"))
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert "nested too deeply" in out.stderr  # the warning naming what was skipped
        assert out.stderr.strip().splitlines()[-1].startswith("ckptdrain: generation 7 of "), \
            out.stderr
    finally:
        shutil.rmtree(hostile)


@pytest.mark.parametrize(("field", "number"), [("handoff", "1" + "0" * 400),
                                               ("committed", "1e20"), ("size", "1" + "0" * 400)])
def test_a_manifest_with_a_number_out_of_range_is_skipped(node: DaemonProcess, tmp_path: Path,
                                                          field: str, number: str) -> None:
    # Found attacking the read side: a clock of 10**400 (no float holds it), a committed
    # clock of 1e20 (no time_t) or a size of 10**400 in one planted MANIFEST.json made ls,
    # verify, restore and gc print an OverflowError traceback, for the whole destination.
    hostile = node.dest / JOB / f"{9:020d}"
    hostile.mkdir()
    obj = json.loads((node.dest / JOB / f"{1:020d}" / "MANIFEST.json").read_text())
    obj["generation"] = 9
    text = json.dumps(obj)
    if field == "size":  # the total stays the shards' sum: only the number is out of range
        rest = obj["total_bytes"] - obj["shards"][0]["size"]
        obj["shards"][0]["size"], obj["total_bytes"] = "@@", "@@total"
        text = json.dumps(obj).replace('"@@total"', str(int(number) + rest))
    else:
        obj["clocks"][field] = "@@"
        text = json.dumps(obj)
    (hostile / "MANIFEST.json").write_text(text.replace('"@@"', number))
    try:
        for args in (("ls", node.dest_uri), ("ls", node.dest_uri, "--job", JOB),
                     ("verify", node.dest_uri, "--job", JOB, "--generation", "1"),
                     ("gc", node.dest_uri, "--dry-run"),
                     ("restore", node.dest_uri, "--job", JOB, "--to", str(tmp_path / "r"))):
            out = cli(node, *args)
            assert "Traceback" not in out.stderr and out.returncode == 0, (args, out.stderr)
        assert sorted(p.name for p in (tmp_path / "r").rglob("*.bin")) == ["w.bin", "y.bin"]
        out = cli(node, "ls", node.dest_uri, "--job", JOB)
        assert "9" not in out.stdout.split() and "1" in out.stdout.split(), out.stdout
    finally:
        shutil.rmtree(hostile)


def test_a_restore_onto_a_full_disk_names_the_file(make_daemon, small_tmpfs: Path) -> None:  # type: ignore[no-untyped-def]
    # Found attacking: it said only "No space left on device; free space there and try
    # again", naming neither the file nor where.
    d: DaemonProcess = make_daemon()
    with d.client().generation("full", 1) as gen:
        gen.put("big.bin", os.urandom(80 << 20))  # more than the 64 MiB filesystem holds
    d.client().wait("full", 1, timeout_s=60)
    to = small_tmpfs / "restored"
    one_sentence(cli(d, "restore", d.dest_uri, "--job", "full", "--generation", "1",
                     "--to", str(to), "--no-local"), 1, str(to), "big.bin", "free space")
    assert not to.exists() or not [p for p in to.rglob("*") if p.is_file()]


def test_a_staging_directory_that_cannot_be_prepared_is_named_as_such(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking the operator's surface: with staging_dir/shards a regular file, start-up
    # said "socket: cannot serve: [Errno 20] Not a directory: .../staging/shards".
    d: DaemonProcess = make_daemon(start=False)
    d.staging.mkdir(parents=True)
    (d.staging / "shards").write_bytes(b"not a directory")
    with pytest.raises(RuntimeError, match="exited") as info:
        d.start()
    message = str(info.value)
    assert "staging_dir: cannot" in message and "socket:" not in message, message
    assert "Traceback" not in message


@pytest.mark.parametrize("argv", [[], ["nosuchcommand"]], ids=["none", "unknown"])
def test_a_missing_or_unknown_command_names_the_program_once(argv: list[str]) -> None:
    # Found attacking: "ckptdrain: ckptdrain: argument COMMAND: invalid choice ...".
    out = subprocess.run([CKPTDRAIN, *argv], capture_output=True, text=True, check=False)
    assert out.returncode == 2
    assert out.stderr.startswith("ckptdrain: ") and "ckptdrain: ckptdrain" not in out.stderr
    assert out.stderr.rstrip().endswith("see `ckptdrain --help`"), out.stderr
