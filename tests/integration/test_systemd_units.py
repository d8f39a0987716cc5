"""The systemd units, checked by systemd's own tools: `systemd-analyze verify` and
`systemd-analyze security --offline=yes` (exposure recorded in docs/deployment.md)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "systemd"
SERVICE = UNITS / "ckptdrain.service"
SOCKET = UNITS / "ckptdrain.socket"
DEPLOYMENT_DOC = ROOT / "docs" / "deployment.md"
# Exposure levels systemd-analyze reports: OK is below 5.0 (4.9 and lower).
MAX_EXPOSURE = 4.9
TOOL_TIMEOUT_S = 60

ANALYZE = shutil.which("systemd-analyze")
pytestmark = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze missing: `make system-deps` installs it"
)


def analyze(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    return subprocess.run(
        [ANALYZE, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT_S,
        check=False,
    )


def unit_settings(path: Path) -> dict[str, list[str]]:
    """Key -> every value it is given, across sections (units allow repeated keys)."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, val = line.partition("=")
        out.setdefault(key.strip(), []).append(val.strip())
    return out


@pytest.fixture
def verifiable(tmp_path: Path) -> Path:
    """Copies of the units whose ExecStart names a binary that exists on this machine:
    `verify` checks the executable, and /usr/bin/ckptdrain is only there once installed."""
    for unit in (SERVICE, SOCKET):
        text = unit.read_text()
        if unit is SERVICE:
            true = shutil.which("true") or "/bin/true"
            text, count = re.subn(
                r"^ExecStart=/usr/bin/ckptdrain\b", f"ExecStart={true}", text, flags=re.M
            )
            assert count == 1, "ExecStart=/usr/bin/ckptdrain ... not found in the service"
        (tmp_path / unit.name).write_text(text)
    return tmp_path


def test_verify_passes(verifiable: Path) -> None:
    result = analyze(
        "verify", "--man=no", "./ckptdrain.service", "./ckptdrain.socket", cwd=verifiable
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # verify reports problems on stderr even when it exits 0 (e.g. unknown keys).
    assert result.stderr.strip() == "", result.stderr


def test_verify_catches_a_broken_unit(verifiable: Path) -> None:
    # The check above is only worth something if verify fails on a bad unit.
    broken = verifiable / "ckptdrain.service"
    broken.write_text(broken.read_text().replace("Type=notify", "Type=notifyy"))
    result = analyze("verify", "--man=no", "./ckptdrain.service", cwd=verifiable)
    assert "Failed to parse service type" in result.stderr


def test_security_exposure_is_ok_and_documented(verifiable: Path) -> None:
    result = analyze("security", "--offline=yes", "./ckptdrain.service", cwd=verifiable)
    assert result.returncode == 0, result.stdout + result.stderr
    match = re.search(
        r"Overall exposure level for ckptdrain\.service: (\d+\.\d+) (\w+)", result.stdout
    )
    assert match, result.stdout
    exposure, verdict = float(match[1]), match[2]
    assert exposure <= MAX_EXPOSURE, result.stdout
    assert verdict in ("OK", "SAFE", "PERFECT"), result.stdout
    # docs/deployment.md states the figure; keep it true when the unit changes.
    assert f"{exposure:.1f} {verdict}" in DEPLOYMENT_DOC.read_text(), (
        f"update docs/deployment.md: exposure is now {exposure:.1f} {verdict}"
    )


def test_service_contract() -> None:
    s = unit_settings(SERVICE)
    assert s["Type"] == ["notify"]
    assert s["ExecStart"] == ["/usr/bin/ckptdrain serve --config /etc/ckptdrain/ckptdrain.toml"]
    assert s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert s["WatchdogSec"] == ["60"]
    assert s["Restart"] == ["on-failure"]
    assert s["TimeoutStopSec"] == ["120"]
    assert s["User"] == ["ckptdrain"] and s["Group"] == ["ckptdrain"]
    assert s["Requires"] == ["ckptdrain.socket"]
    assert "ckptdrain.socket" in s["After"][0].split()
    assert s["StateDirectory"] == ["ckptdrain"]
    assert "/var/lib/ckptdrain" in s["ReadWritePaths"]
    assert s["CapabilityBoundingSet"] == [""]
    assert s["RestrictAddressFamilies"] == ["AF_UNIX AF_INET AF_INET6"]
    # A user namespace would hide client uids from SO_PEERCRED.
    assert "PrivateUsers" not in s


def test_socket_contract() -> None:
    s = unit_settings(SOCKET)
    assert s["ListenStream"] == ["/run/ckptdrain.sock"]
    assert s["SocketMode"] == ["0660"]
    assert s["SocketGroup"] == ["ckptdrain"]
    assert s["RemoveOnStop"] == ["yes"]
    # The socket survives a daemon restart: nothing stops or restarts it with the service
    # (with PartOf=, `systemctl restart ckptdrain.service` restarted the socket too and
    # RemoveOnStop= unlinked it under connecting clients).
    for tie in ("PartOf", "BindsTo", "StopWhenUnneeded"):
        assert tie not in s, tie
    service = unit_settings(SERVICE)
    assert "PartOf" not in service and "BindsTo" not in service
    # Not inside the service's RuntimeDirectory (removed when the service stops).
    assert "RuntimeDirectory" not in unit_settings(SERVICE)


def _syscalls(name: str) -> set[str]:
    """A syscall, or every syscall of a group (``@resources``), as systemd expands it."""
    if not name.startswith("@"):
        return {name}
    out = analyze("syscall-filter", name, cwd=ROOT).stdout
    names: set[str] = set()
    for line in out.splitlines():
        entry = line.strip()
        if entry and not entry.startswith("#") and entry != name:
            names |= _syscalls(entry)
    return names


def test_the_drain_may_lower_its_own_priority() -> None:
    # Found attacking the unit: setpriority and ioprio_set are in @resources, which the
    # filter took away, so the drain's lowering of its CPU and I/O priority failed with EPERM
    # unseen and hand-offs and drains ran at one priority (docs/architecture.md's split).
    allowed: set[str] = set()
    for value in unit_settings(SERVICE)["SystemCallFilter"]:
        deny = value.startswith("~")
        names = set().union(*(_syscalls(n) for n in value.lstrip("~").split()))
        allowed = allowed - names if deny else allowed | names
    assert "setpriority" in allowed and "ioprio_set" in allowed
    assert "reboot" not in allowed and "setrlimit" not in allowed  # the rest stays filtered
