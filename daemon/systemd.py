"""systemd integration written by hand: the sd_notify datagrams and socket activation.

Both protocols are a few lines (sd_notify(3), sd_listen_fds(3)); writing them here avoids a
dependency on python-systemd and its C library. Outside systemd every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping, MutableMapping

from ckptdrain.daemon.errors import DaemonError

__all__ = ["SD_LISTEN_FDS_START", "Notifier", "SocketActivationError", "listen_fds"]

log = logging.getLogger(__name__)

SD_LISTEN_FDS_START = 3
NOTIFY_TIMEOUT_S = 1.0


class SocketActivationError(DaemonError, RuntimeError):
    """systemd passed sockets the daemon cannot serve: fix ``ListenStream=`` in ckptdrain.socket
    (one Unix stream socket path, no ``Accept=yes``)."""


class Notifier:
    """Sends READY/STATUS/WATCHDOG/STOPPING/RELOADING to ``$NOTIFY_SOCKET``.

    ``$NOTIFY_SOCKET`` is a filesystem path or an abstract socket written ``@name``. When it is
    unset (not under systemd, or ``Type=`` is not ``notify``) every method does nothing and
    returns False. A message that cannot be delivered is logged, not raised: a lost STATUS must
    never stop a drain, and a lost READY or WATCHDOG is acted on by systemd itself.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._address = _notify_address(env.get("NOTIFY_SOCKET", ""))
        self._watchdog_s = _watchdog_interval(env)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def ready(self, status: str | None = None) -> bool:
        """The socket is served: systemd may start units ordered after this one."""
        return self._send("READY=1" + _status_field(status))

    def status(self, text: str) -> bool:
        """One line shown by ``systemctl status``."""
        return self._send(_status_field(text).lstrip("\n"))

    def watchdog(self) -> bool:
        """Still alive; send at :meth:`watchdog_interval_s`."""
        return self._send("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        """Shutting down (after SIGTERM): journalling in-flight work."""
        return self._send("STOPPING=1" + _status_field(status))

    def reloading(self, status: str | None = None) -> bool:
        """Reloading configuration (SIGHUP); call :meth:`ready` once done.

        MONOTONIC_USEC is what ``Type=notify-reload`` (systemd 253+) requires to match the
        reload to this message; older systemd ignores it.
        """
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self._send(f"RELOADING=1\nMONOTONIC_USEC={usec}" + _status_field(status))

    def watchdog_interval_s(self) -> float | None:
        """Seconds between WATCHDOG=1 messages (half of ``WatchdogSec=``), or None when the
        watchdog is off or armed for another process."""
        return self._watchdog_s

    def _send(self, message: str) -> bool:
        if self._address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(NOTIFY_TIMEOUT_S)
                sock.connect(self._address)
                sock.sendall(message.encode("utf-8"))
        except OSError as exc:
            log.warning(
                "cannot notify systemd at %r (%s): check NotifyAccess= and that "
                "NOTIFY_SOCKET is the manager's socket",
                self._address,
                exc,
            )
            return False
        return True


def _notify_address(value: str) -> str | None:
    if value.startswith("@"):
        # Abstract namespace: the leading NUL is what the kernel reads as "abstract".
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    if value:
        log.warning(
            "ignoring NOTIFY_SOCKET=%r: only Unix socket paths and @abstract are supported", value
        )
    return None


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    # Half the timeout, as sd_watchdog_enabled(3) advises: one late message must not kill us.
    return int(usec) / 2 / 1_000_000


def _status_field(text: str | None) -> str:
    if text is None:
        return ""
    # A newline would start a new assignment in the datagram; STATUS= is one line.
    return "\nSTATUS=" + " ".join(text.splitlines())


def listen_fds(environ: MutableMapping[str, str] | None = None) -> list[socket.socket]:
    """The sockets systemd passed (``LISTEN_FDS`` from fd 3), or ``[]`` when not activated.

    Unsets ``LISTEN_PID``/``LISTEN_FDS``/``LISTEN_FDNAMES`` so child processes never take the
    fds for theirs, and marks the fds close-on-exec. Every fd must be a listening Unix stream
    socket, else :class:`SocketActivationError`.
    """
    env = os.environ if environ is None else environ
    pid = env.pop("LISTEN_PID", "")
    count = env.pop("LISTEN_FDS", "")
    env.pop("LISTEN_FDNAMES", None)
    if not pid or not count:
        return []
    if not pid.isdigit() or int(pid) != os.getpid():
        # Meant for another process (we were exec'd by the activated one): not ours to take.
        return []
    if not count.isdigit():
        raise SocketActivationError(f"LISTEN_FDS={count!r} is not a number of file descriptors")

    sockets: list[socket.socket] = []
    try:
        for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + int(count)):
            os.set_inheritable(fd, False)
            try:
                sock = socket.socket(fileno=fd)
            except OSError as exc:
                raise SocketActivationError(
                    f"fd {fd} passed by systemd is not a socket ({exc.strerror})"
                ) from exc
            sockets.append(sock)
            if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
                raise SocketActivationError(
                    f"fd {fd} passed by systemd is {sock.family.name}/{sock.type.name}, "
                    "not a Unix stream socket: use ListenStream=/run/ckptdrain.sock"
                )
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                raise SocketActivationError(
                    f"fd {fd} passed by systemd is not listening: remove Accept=yes"
                )
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets
