"""Destinations behind one small async interface; nothing outside this package asks which."""

from ckptdrain.daemon.backends.base import Backend, BackendError, ObjectInfo, open_backend

__all__ = ["Backend", "BackendError", "ObjectInfo", "open_backend"]
