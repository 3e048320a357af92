"""Temporary, restored changes to the process environment, for libraries that read their
configuration only from there (UCX, NIXL). The library itself never reads the environment for
its own configuration."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping

__all__ = ["process_environment"]

_LOCK = threading.Lock()


@contextlib.contextmanager
def process_environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set `values` in the process environment while a library reads its configuration from
    there (NIXL creating an agent and its UCX context; an old UCX creating its transports), then
    put back what was there before, under one process-wide lock.

    For UCX options that the library cannot be given otherwise: `UCX_*` values with a comma,
    which NIXL's `engine_config` cannot carry (`backends.nixl`), and transport options that UCX
    before 1.17 cannot take through `ucp_config_modify` (`backends.ucx_native`). Another thread
    that reads the environment at that very moment sees them, nothing later does. The
    environment is read here only to be restored.
    """
    if not values:
        yield
        return
    with _LOCK:
        before = {key: os.environ.get(key) for key in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for key, value in before.items():
                if value is None:
                    del os.environ[key]
                else:
                    os.environ[key] = value
