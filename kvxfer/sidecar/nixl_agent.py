"""Creating the NIXL agent the way the sidecar runs it, and naming its errors.

The only module that imports NIXL's Python API. The agent it returns is used by the NIXL
port's thread alone (``kvxfer.sidecar.nixl_port``), or by the loop under the port's lock.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from kvxfer.errors import ErrorCode

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def import_nixl() -> Any:
    """The NIXL Python API module from whichever single-variant wheel is installed.

    ``nixl_cu12`` / ``nixl_cu13`` import without torch; the ``nixl`` meta package drags
    torch in (2-3 s), so it is the last resort.
    """
    for module in ("nixl_cu12", "nixl_cu13", "nixl._api"):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        return mod
    raise ImportError("no NIXL Python package found: pip install nixl-cu12 (or nixl-cu13)")


def create_agent(name: str, ucx_error_mode: str, num_threads: int) -> Any:
    """A NIXL agent with the UCX backend as the sidecar runs it: NIXL's progress thread off
    (it spins a full core), ``num_threads`` UCX worker threads, strict synchronization (the
    agent serializes calls into its backends, and UCX workers are created SERIALIZED: any
    thread may drive them, one at a time; the port's inline reads rely on it)."""
    nixl = import_nixl()
    # (a NIXL without sync modes: with no progress thread its UCX workers are SERIALIZED too)
    sync = getattr(nixl, "nixl_thread_sync_t", None)
    extra = {"sync_mode": sync.NIXL_THREAD_SYNC_STRICT} if sync is not None else {}
    conf = nixl.nixl_agent_config(enable_prog_thread=False, backends=[], num_threads=num_threads, **extra)
    agent = nixl.nixl_agent(name, conf)
    params = {"ucx_error_handling_mode": ucx_error_mode}
    if num_threads > 0:
        params["num_threads"] = str(num_threads)
    agent.create_backend("UCX", params)
    return agent


def error_code(exc: BaseException) -> str:
    """NIXL raises one exception class per error and CUDA variant, with no common base."""
    name = type(exc).__name__
    if "RemoteDisconnect" in name:
        return ErrorCode.PEER_DISCONNECTED
    return ErrorCode.TRANSFER_ERROR
