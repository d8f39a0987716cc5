"""One error root for the daemon: every exception class it defines derives from DaemonError,
so the CLI (the only place that maps errors to exit codes) can tell its own from a bug."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import ckptdrain.daemon
import ckptdrain.daemon.backends
from ckptdrain.daemon.errors import DaemonError


def daemon_modules() -> list[str]:
    names = []
    for package in (ckptdrain.daemon, ckptdrain.daemon.backends):
        for info in pkgutil.iter_modules(package.__path__):
            names.append(f"{package.__name__}.{info.name}")
    return names


def test_every_daemon_exception_derives_from_the_root() -> None:
    strays = []
    for name in daemon_modules():
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (cls.__module__ == name and issubclass(cls, BaseException)
                    and not issubclass(cls, DaemonError)):
                strays.append(f"{name}.{cls.__name__}")
    assert not strays, f"exceptions outside DaemonError: {strays}"


def test_the_root_covers_the_errors_users_meet() -> None:
    from ckptdrain.daemon.backends.base import BackendError
    from ckptdrain.daemon.catalog import CatalogError
    from ckptdrain.daemon.config import ConfigError
    from ckptdrain.daemon.journalfaults import JournalError

    for cls in (BackendError, CatalogError, ConfigError, JournalError):
        assert issubclass(cls, DaemonError)
