"""The Debian package, installed for real: dpkg -i, the installed units pass systemd-analyze
verify and security --offline, the installed daemon (as the ckptdrain user it created) takes
a save through the installed client and the installed CLI restores it, and the package
removes cleanly.

Building the package takes minutes (a venv with the daemon's dependencies), so this runs when
asked: ``make test-deb`` (builds it, then runs this with CKPTDRAIN_TEST_DEB=<the .deb>), or
CKPTDRAIN_TEST_DEB=1 to build it here.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ASKED = os.environ.get("CKPTDRAIN_TEST_DEB", "")
UNITS = Path("/lib/systemd/system")

pytestmark = [
    pytest.mark.skipif(not ASKED, reason="builds a Debian package (minutes): run `make test-deb` "
                       "or set CKPTDRAIN_TEST_DEB=1"),
    pytest.mark.skipif(shutil.which("dpkg") is None or shutil.which("dpkg-deb") is None,
                       reason="dpkg is not installed (not a Debian system)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="dpkg -i needs root"),
]


def run(*cmd: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, **kw)  # type: ignore[call-overload, no-any-return]


def installed_env(**extra: str) -> dict[str, str]:
    # Nothing from this checkout or its venv: only what the package installed.
    return {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8", **extra}


@pytest.fixture(scope="module")
def deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if ASKED not in ("1", "yes", "true"):
        path = Path(ASKED)
        assert path.is_file(), f"CKPTDRAIN_TEST_DEB={ASKED} is not a file"
        return path
    out = run(str(ROOT / "packaging" / "deb" / "build.sh"), str(tmp_path_factory.mktemp("deb")))
    assert out.returncode == 0, out.stderr[-3000:]
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def installed(deb: Path) -> Iterator[Path]:
    if run("dpkg-query", "-W", "ckptdrain").returncode == 0:
        pytest.skip("a ckptdrain package is already installed here; not replacing it")
    had_user = run("getent", "passwd", "ckptdrain").returncode == 0
    out = run("dpkg", "-i", str(deb))
    assert out.returncode == 0, out.stdout + out.stderr
    try:
        yield deb
    finally:
        out = run("dpkg", "--purge", "ckptdrain")
        assert out.returncode == 0, out.stdout + out.stderr
        for gone in ("/opt/ckptdrain", "/usr/bin/ckptdrain", UNITS / "ckptdrain.service",
                     UNITS / "ckptdrain.socket", "/etc/ckptdrain/ckptdrain.toml",
                     "/usr/share/doc/ckptdrain"):
            assert not os.path.lexists(gone), f"{gone} left behind by dpkg --purge"
        if not had_user:
            run("userdel", "ckptdrain")
            run("groupdel", "ckptdrain")


def test_files_user_and_units(installed: Path) -> None:
    assert Path("/usr/bin/ckptdrain").resolve() == Path("/opt/ckptdrain/bin/ckptdrain")
    assert Path("/etc/ckptdrain/ckptdrain.toml").is_file()
    assert Path("/usr/share/doc/ckptdrain/operations.md").is_file()
    user = pwd.getpwnam("ckptdrain")
    assert user.pw_uid < 1000 and user.pw_dir == "/var/lib/ckptdrain"
    version = run("/usr/bin/ckptdrain", "--version", env=installed_env())
    assert version.returncode == 0 and version.stdout.startswith("ckptdrain "), version.stderr
    check = run("/usr/bin/ckptdrain", "config", "check", "--config",
                "/etc/ckptdrain/ckptdrain.toml", env=installed_env())
    assert check.returncode == 0, check.stderr

    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: `make system-deps`")
    units = [str(UNITS / "ckptdrain.service"), str(UNITS / "ckptdrain.socket")]
    verify = run("systemd-analyze", "verify", *units)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    security = run("systemd-analyze", "security", "--offline=yes", units[0])
    assert security.returncode == 0, security.stdout + security.stderr
    level = re.search(r"Overall exposure level for ckptdrain\.service: (\d+\.\d+)",
                      security.stdout)
    assert level and float(level[1]) <= 2.0, security.stdout[-500:]


def test_the_installed_daemon_saves_and_restores(installed: Path) -> None:
    user = pwd.getpwnam("ckptdrain")
    root = Path(tempfile.mkdtemp(prefix="ckd-deb-", dir="/tmp"))
    try:
        for sub in ("staging", "dest", "state"):
            (root / sub).mkdir()
            os.chown(root / sub, user.pw_uid, user.pw_gid)
        os.chmod(root, 0o755)
        sock = root / "state" / "d.sock"
        env = installed_env(CKPTDRAIN_SOCKET=str(sock), CKPTDRAIN_STAGING_DIR=str(root / "staging"),
                            CKPTDRAIN_DESTINATION__URI=f"file://{root / 'dest'}",
                            CKPTDRAIN_METRICS__LISTEN="127.0.0.1:0", CKPTDRAIN_NODE_ID="debtest")
        log = open(root / "daemon.log", "wb")  # noqa: SIM115 - the child owns it
        daemon = subprocess.Popen(["/usr/bin/ckptdrain", "serve", "--config",
                                   "/etc/ckptdrain/ckptdrain.toml"], env=env, stdout=log,
                                  stderr=subprocess.STDOUT, user=user.pw_uid, group=user.pw_gid,
                                  extra_groups=[])
        log.close()
        try:
            deadline = time.monotonic() + 60
            while not sock.exists():
                assert daemon.poll() is None, (root / "daemon.log").read_text()
                assert time.monotonic() < deadline, (root / "daemon.log").read_text()
                time.sleep(0.1)
            data = os.urandom(3 << 20)
            (root / "shard.bin").write_bytes(data)
            save = (
                "from ckptdrain.client import Client\n"
                f"c = Client({str(sock)!r})\n"
                "with c.generation('debjob', 7) as g:\n"
                f"    g.put_file('model/shard.bin', {str(root / 'shard.bin')!r})\n"
                "print(c.wait('debjob', 7, timeout_s=60)['committed'])\n"
            )
            out = run("/opt/ckptdrain/bin/python", "-c", save, env=installed_env())
            assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
            to = root / "restored"
            out = run("/usr/bin/ckptdrain", "restore", f"file://{root / 'dest'}", "--job",
                      "debjob", "--to", str(to), "--socket", str(sock), env=installed_env())
            assert out.returncode == 0, out.stderr
            got = (to / "model" / "shard.bin").read_bytes()
            assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
        finally:
            daemon.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                assert daemon.wait(60) == 0, (root / "daemon.log").read_text()
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait()
    finally:
        shutil.rmtree(root, ignore_errors=True)
