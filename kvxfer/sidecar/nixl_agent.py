"""Creating the NIXL agent the way the sidecar runs it, and naming its errors.

The only module that imports NIXL's Python API. The agent it returns is used by the NIXL
port's thread alone (``kvxfer.sidecar.nixl_port``), or by the loop under the port's lock.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from kvxfer.errors import ConfigError, ErrorCode

log = logging.getLogger("kvxfer.transfer")

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


# What a sidecar whose memory is on a GPU sets before UCX reads its configuration (``--cuda``),
# unless the operator set it: measured by ``make gpu-check`` on one H100 (UCX 1.23, nixl-cu13
# 1.5.1, two processes on one GPU, no NVLink), benchmarks/gpu_latest.json.
CUDA_UCX_DEFAULTS = {
    # UCX's memtype cache only knows allocations it saw being made: IPC-imported VRAM is
    # classified as host memory and its registration fails (2026-11-22).
    "UCX_MEMTYPE_CACHE": "n",
    # Without NVLink UCX leaves cuda_ipc's GET (a READ) off and READs go over tcp: raw NIXL
    # READs of 32 KiB descriptors moved 0.07 GB/s; with it on, 3.3 GB/s (32 MiB) and 5.5 GB/s
    # (512 MiB) on engine cudaMalloc memory (2026-11-26).
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
}


def cuda_ucx_defaults(env: Any) -> None:
    """``CUDA_UCX_DEFAULTS`` into ``env`` (``os.environ``, or a child's), what is set wins."""
    for k, v in CUDA_UCX_DEFAULTS.items():
        env.setdefault(k, v)


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
    try:
        agent.create_backend("UCX", params)
    except Exception as e:  # (NIXL says only NIXL_ERR_BACKEND; UCX's own line is on stderr)
        if ucx_error_mode != "peer":
            raise  # (not a setting: exit 1, which a supervisor restarts; a ConfigError exits 2)
        tls = os.environ.get("UCX_TLS", "(unset)")
        raise ConfigError(
            f"NIXL could not create its UCX backend ({e}) with ucx_error_mode={ucx_error_mode!r} and "
            f"UCX_TLS={tls}: error mode 'peer' needs a transport that reports a peer's failure (tcp or "
            "an RDMA device); UCX_TLS without one refuses it (mode 'none' does not need one)") from e
    return agent


def error_code(exc: BaseException) -> str:
    """NIXL raises one exception class per error and CUDA variant, with no common base."""
    name = type(exc).__name__
    if "RemoteDisconnect" in name:
        return ErrorCode.PEER_DISCONNECTED
    return ErrorCode.TRANSFER_ERROR


def xfer_state(agent: Any, handle: Any) -> str:
    """A transfer's state on ``agent`` ("ERR" when NIXL raises: a handle it no longer knows)."""
    try:
        return str(agent.check_xfer_state(handle))
    except Exception:
        return "ERR"


def release_or_park(agent: Any, handle: Any, parked: list[Any]) -> bool:
    """Release a transfer handle; one the backend refuses (still active) is parked in
    ``parked``, to be released again later and never touched otherwise (False)."""
    try:
        agent.release_xfer_handle(handle)
        return True
    except Exception as e:
        log.debug("xfer handle release deferred: %s", e)
        parked.append(handle)
        return False


def release_parked(agent: Any, parked: list[Any]) -> list[Any]:
    """Release again the handles parked by ``release_or_park``; what is still refused."""
    still: list[Any] = []
    for handle in parked:
        release_or_park(agent, handle, still)
    return still
