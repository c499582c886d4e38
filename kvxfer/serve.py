"""``kvxfer serve``: the daemon with its control plane, as one process.

The top of the sidecar's layers: it builds the ``Sidecar`` (the app), opens it, starts the
gRPC control and health servers over it (they read its snapshots, call its operations and
follow its lifecycle; the app never imports them), runs it until it stops, and closes
everything in the reverse order.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from kvxfer import gc_heap
from kvxfer.config import Config
from kvxfer.control.access import AccessPolicy, load_policy
from kvxfer.errors import ConfigError, ListenError
from kvxfer.logs import setup_logging
from kvxfer.sidecar.app import Sidecar
from kvxfer.sidecar.nixl_staging import warm_thread

log = logging.getLogger("kvxfer.sidecar")

SETTLE_POLL_S = 0.05  # how often the heap's second settle looks for an idle moment
SETTLE_WAIT_S = 60.0  # and settles anyway after this long busy


async def serve(sidecar: Sidecar, policy: AccessPolicy, on_hup: Callable[[], None] | None = None) -> None:
    """Open the sidecar, start its control plane, serve until stopped, close."""
    config = sidecar.config
    pauses = gc_heap.install()
    sidecar.observer.registry.register(gc_heap.GcCollector(pauses))  # kvxfer_gc_* (before /metrics serves)
    await sidecar.open()
    control: list[Any] = []
    if config.control_target or config.health_target:
        from kvxfer.control.service import start_control_server

        try:
            control = await start_control_server(sidecar.ops, config.control_target, policy,
                                                 config.health_target)
        except Exception as e:  # grpc says RuntimeError("Failed to bind ...")
            await sidecar.close()
            raise ListenError(f"control listener {config.control_target or ''} "
                              f"{config.health_target or ''}: {e}".replace("  ", " ")) from None
    gc_heap.settle("started", pauses)  # (nothing served yet: what start-up built, frozen out of later walks)
    settled = asyncio.ensure_future(_settle_after_imports(sidecar, pauses))
    try:
        await sidecar.run(on_hup)
    finally:
        settled.cancel()
        await asyncio.gather(*(c.stop(0.5) for c in control))
        await sidecar.close()


async def _settle_after_imports(sidecar: Sidecar, pauses: gc_heap.GcPauses) -> None:
    """The staging copies import torch in the background from ``open``: once that ended, its
    modules (~140,000 objects a full collection would walk, ~100 ms each) are frozen too, on
    the loop at a moment no receive is in flight and no lease held (``lifecycle``'s busy: a
    request's objects frozen mid-flight would never be collected if they became garbage in a
    cycle); a sidecar busy for ``SETTLE_WAIT_S`` on end settles anyway (what it then keeps
    for good is bounded, the pauses it saves are not)."""
    warming = warm_thread()
    if warming is None:
        return
    give_up = 0.0
    while True:  # (polled: the import is a thread, and busy a view the loop recomputes)
        if not warming.is_alive():
            give_up = give_up or time.monotonic() + SETTLE_WAIT_S
            if not sidecar.lifecycle.view.busy or time.monotonic() >= give_up:
                break
        await asyncio.sleep(SETTLE_POLL_S)
    gc_heap.settle("after the staging copies' import", pauses)


def _tie_to_parent() -> bool:
    """A sidecar that a test, a benchmark or the demo started (``KVXFER_PARENT_PID``, set by
    ``kvxfer.testing.procs``) is stopped (SIGINT) when that process dies, a crash included:
    no orphaned sidecars. False: that process is gone already."""
    want = os.environ.get("KVXFER_PARENT_PID", "")
    if not want.isdigit():
        return True
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGINT), 0, 0, 0)  # PR_SET_PDEATHSIG
    return os.getppid() == int(want)  # (it may have died before the prctl)


def run_server(config: Config, reload: Callable[[], Config] | None = None) -> int:
    """Run the daemon until SIGINT, or SIGTERM and a drain; returns the exit status.
    ``reload``: the configuration read again (SIGHUP applies its log level)."""
    import faulthandler

    import uvloop

    if not _tie_to_parent():
        return 1

    faulthandler.enable(all_threads=True)  # a crash in NIXL/UCX leaves every stack in the log
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` dumps every stack

    setup_logging(config)

    def on_hup() -> None:
        try:
            new = reload() if reload is not None else config
        except ConfigError as e:
            log.error("SIGHUP: configuration not reloaded: %s", e)
            return
        logging.getLogger().setLevel(new.log_level.upper())
        log.warning("SIGHUP: log level now %s", new.log_level.upper())

    try:
        sidecar = Sidecar(config)
        policy = load_policy(config)
    except ConfigError as e:  # e.g. an unreadable secret file: refuse to start rather than run open
        log.critical("%s", e)
        return 2
    try:
        uvloop.run(serve(sidecar, policy, on_hup))
    except (ConfigError, OSError) as e:  # a listener could not bind, NIXL refused its backend: which, why
        log.critical("cannot start: %s", e)
        return 2
    return sidecar.exit_code
