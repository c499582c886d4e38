"""The sidecar daemon, in layers (each imports only from the layers before it; the
``tests/test_layers.py`` walk holds every module to it):

1. pure logic: descriptor plans, admission, the receive state machine (no asyncio, ZMQ,
   NIXL or threads; callers pass ``now``);
2. ports: the one typed door to the NIXL thread, the peer book;
3. I/O shells: the engine socket server, the peer client and server, the memory channel;
4. the app (``app.Sidecar``): builds the parts in order, owns the lifecycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvxfer.sidecar.app import Sidecar, run_server

__all__ = ["Sidecar", "run_server"]


def __getattr__(name: str) -> Any:
    # The app (layer 4) is imported on first use, not with the package: a module of an
    # earlier layer (``kvxfer.sidecar.mapping``, imported by ``kvxfer.transfer``, which the
    # app imports) must be importable without importing the app first.
    if name in __all__:
        from kvxfer.sidecar import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
