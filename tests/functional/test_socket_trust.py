"""Whom a client trusts with its bytes and descriptors inside a user namespace (a rootless
container), where uids say little: each case was found attacking the client's check of the
listener (client/daemonsocket.py check_listener), and each has a squatter that must get nothing,
not even the client's first request."""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ckptdrain.client import Client, DaemonUnavailable
from tests.conftest import DaemonProcess
from tests.functional import otheruser

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="user namespaces with chosen maps need root (CI runs as root)")
CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000


def in_a_user_namespace(maps: str, inner_uid: int, fn: Callable[[], str]) -> str:
    """``fn()`` in a child in a new user namespace whose uid and gid maps (``maps``) this root
    process writes, running there as ``inner_uid``."""
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWUSER) != 0:
                os.write(w, b"NO USER NAMESPACE")
                os._exit(0)
            os.write(ready_w, b"x")
            os.read(go_r, 1)
            os.setgroups([])
            os.setgid(inner_uid)
            os.setuid(inner_uid)
            try:
                out = fn()
            except BaseException as exc:
                out = f"ERROR {type(exc).__name__}: {exc}"
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    if os.read(ready_r, 1):
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(maps)
        os.write(go_w, b"x")
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    if out == "NO USER NAMESPACE":
        pytest.skip("no user namespaces here")
    return out


def squatter(path: Path, uid: int) -> tuple[int, int]:
    """A process of ``uid`` listening at ``path``; its answer says how many bytes it got."""
    ready_r, ready_w = os.pipe()

    def squat() -> str:
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        os.chmod(path, 0o777)
        server.listen(1)
        os.write(ready_w, b"x")
        server.settimeout(15)
        conn, _ = server.accept()
        conn.settimeout(2)
        try:
            return f"GOT {len(conn.recv(4096))} bytes"
        except TimeoutError:
            return "GOT 0 bytes"

    child = otheruser.start_as(uid, squat)
    os.read(ready_r, 1)
    return child


def attempt(path: str | Path) -> str:
    try:
        Client(path, timeout_s=2, connect_timeout_s=2).status()
    except DaemonUnavailable as exc:
        return f"REFUSED {exc}"
    return "CONNECTED"


@pytest.fixture
def shared(short_tmp: Path) -> Path:
    os.chmod(short_tmp, 0o1777)  # as /tmp
    return short_tmp


@pytest.fixture
def system_socket_dir() -> Iterator[Path]:
    """A root-only directory under /run standing for the node's socket's."""
    runtime = Path(tempfile.mkdtemp(prefix="ckptdrain-test-", dir="/run"))
    os.chmod(runtime, 0o755)
    yield runtime
    shutil.rmtree(runtime, ignore_errors=True)


def test_another_containers_root_is_not_the_nodes_root(shared: Path) -> None:
    # docker userns-remap: every container's root is the same host uid (100000). Container
    # B's root listening on a shared path read as uid 0 to container A's user, and was
    # trusted as the node's root.
    squat = squatter(shared / "sq.sock", 100000)
    said = in_a_user_namespace("0 100000 1\n1000 101000 1", 1000,
                               lambda: attempt(shared / "sq.sock"))
    assert said.startswith("REFUSED") and "user namespace" in said, said
    assert otheruser.answer(squat) == "GOT 0 bytes"


def test_the_nodes_socket_is_trusted_only_by_its_exact_path(
    shared: Path, system_socket_dir: Path
) -> None:
    # A path that reads as the node's socket once '..' is taken as text, but that the kernel
    # resolves through a link into the attacker's directory, was trusted as the node's.
    from ckptdrain.client import daemonsocket

    evil = shared / "e"
    deep = evil / "a" / "b" / "c" / "d"
    target = evil / "run" / system_socket_dir.name
    deep.mkdir(parents=True)
    target.mkdir(parents=True)
    (evil / "l").symlink_to(deep)
    for path in (evil, *evil.rglob("*")):
        os.chown(path, 1001, 1001, follow_symlinks=False)
    crafted = str(evil / "l") + "/.." * len(evil.parts) + f"/run/{system_socket_dir.name}/ckptdrain.sock"
    assert os.path.abspath(crafted) == str(system_socket_dir / "ckptdrain.sock")
    squat = squatter(target / "ckptdrain.sock", 1001)

    def victim() -> str:
        daemonsocket.SYSTEM_SOCKET_PATH = str(system_socket_dir / "ckptdrain.sock")
        return attempt(crafted)

    said = in_a_user_namespace("0 65534 1", 0, victim)
    assert said.startswith("REFUSED"), said
    assert otheruser.answer(squat) == "GOT 0 bytes"


def test_a_namespace_without_proc_trusts_no_uid(shared: Path) -> None:
    # With /proc covered (a container without procfs) the client took itself to be in the
    # node's own namespace, and the overflow uid named in CKPTDRAIN_DAEMON_UID (as an older
    # refusal advised) trusted every unmapped user again.
    squat = squatter(shared / "sq.sock", 1001)

    def victim() -> str:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWNS) != 0:
            return f"NO MOUNT NAMESPACE {ctypes.get_errno()}"
        libc.mount(b"none", b"/", None, 0x40000 | 0x4000, None)  # MS_REC | MS_PRIVATE
        if libc.mount(b"tmpfs", b"/proc", b"tmpfs", 0, None) != 0:
            return f"NO MOUNT {ctypes.get_errno()}"
        os.environ["CKPTDRAIN_DAEMON_UID"] = "65534"
        return attempt(shared / "sq.sock")

    said = in_a_user_namespace("0 4500 1", 0, victim)
    assert said.startswith("REFUSED"), said
    assert otheruser.answer(squat) == "GOT 0 bytes"


def test_a_nested_namespace_does_not_trust_the_outer_containers_root(shared: Path) -> None:
    # Found attacking: container A maps "0 100000 65536" (docker userns-remap: every
    # container's root is host uid 100000); inside it, its root starts a nested namespace
    # mapping "0 0 65536" (podman in podman, `unshare -r`). A map names the uids of the
    # namespace above, so there host uid 100000, another container's root, read as mapped to
    # uid 0 and was trusted as the node's root.
    squat = squatter(shared / "sq.sock", 100000)

    def containers_root() -> str:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: this process's /proc files are its own
        r, w = os.pipe()
        go_r, go_w = os.pipe()
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                if libc.unshare(CLONE_NEWUSER) != 0:
                    os.write(w, b"NO NESTED NAMESPACE")
                    os._exit(0)
                os.write(ready_w, b"x")
                os.read(go_r, 1)
                os.setgroups([])
                os.setgid(1000)
                os.setuid(1000)
                os.write(w, attempt(shared / "sq.sock").encode())
            except BaseException as exc:
                os.write(w, f"ERROR {exc!r}".encode())
            finally:
                os._exit(0)
        os.close(w)
        os.read(ready_r, 1)
        try:
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{pid}/{name}", "w") as f:
                    f.write("0 0 65536")
        except OSError as exc:
            return f"ERROR writing the nested map: {exc}"
        finally:
            os.write(go_w, b"x")
        with os.fdopen(r, "rb") as f:
            out = f.read().decode()
        os.waitpid(pid, 0)
        return out

    said = in_a_user_namespace("0 100000 65536", 0, containers_root)
    assert said.startswith("REFUSED") and "user namespace" in said, said
    assert otheruser.answer(squat) == "GOT 0 bytes"


def test_a_daemon_of_the_callers_own_uid_in_the_same_namespace_is_trusted(short_tmp: Path) -> None:
    # Found attacking the namespace rule: inside any user namespace the client refused the
    # daemon its own user ran beside it (`make demo` in a rootless container), though a
    # listener of the caller's own mapped uid is the caller's own kernel uid.
    def same_container() -> str:
        server = socket.socket(socket.AF_UNIX)
        path = short_tmp / "own.sock"
        server.bind(str(path))
        server.listen(1)
        pid = os.fork()
        if pid == 0:  # the "daemon": counts what the client sent before it gave up
            try:
                conn, _ = server.accept()
                conn.settimeout(3)
                got = conn.recv(4096)
                os._exit(0 if got else 1)
            except BaseException:
                os._exit(2)
        said = attempt(path)
        return f"{said[:40]} / listener got bytes: {os.waitpid(pid, 0)[1] == 0}"

    os.chmod(short_tmp, 0o777)
    said = in_a_user_namespace("0 4500 1", 0, same_container)
    assert said.endswith("listener got bytes: True"), said


def test_the_nodes_socket_is_trusted_from_a_user_namespace_and_nothing_else(
    shared: Path, system_socket_dir: Path, tmp_path: Path
) -> None:
    # Found attacking: from a rootless container the node's root daemon reads as the
    # overflow uid and was refused; naming that uid, as the refusal said, then trusted any
    # user not mapped into the namespace. Only the node's own socket is trusted there.
    from ckptdrain.client import daemonsocket

    node_socket = system_socket_dir / "ckptdrain.sock"
    (tmp_path / "node").mkdir()
    d = DaemonProcess(root=tmp_path / "node", socket_path=node_socket,
                      dest_uri=f"file://{tmp_path / 'dest'}",
                      overrides={"CKPTDRAIN_ACCESS__SOCKET_MODE": "0666",
                                 "CKPTDRAIN_ACCESS__ALLOWED_UIDS": "[65534]"})
    d.start()
    squat = squatter(shared / "sq.sock", 1001)

    def in_a_container() -> str:
        daemonsocket.SYSTEM_SOCKET_PATH = str(node_socket)  # this test's node socket
        with open("/proc/sys/kernel/overflowuid") as f:  # what the node's root reads as
            os.environ["CKPTDRAIN_DAEMON_UID"] = f.read().strip()  # as once advised
        node = Client(node_socket, timeout_s=10).status()["node_id"]
        return f"{node} | {attempt(shared / 'sq.sock')}"

    try:
        said = in_a_user_namespace("0 65534 1", 0, in_a_container)
        assert said.startswith(f"{d.node_id} | REFUSED") and "user namespace" in said, said
        assert otheruser.answer(squat) == "GOT 0 bytes"
    finally:
        d.stop()
