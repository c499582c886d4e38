"""Requests an engine gave up on while this sidecar could not tell it otherwise.

When a sidecar restarts, the engine's worker reports every load it had posted as failed
(vLLM recomputes into those blocks) and frees every block it held for a decode, then
registers again. The scheduler sent those loads' ``Recv`` and those blocks' ``Hold`` on its
own socket, and nothing orders them against the worker's registration: one can reach the new
sidecar after it. Read, it would overwrite blocks vLLM is recomputing; held, a decode would
read blocks that already belong to another request. So the registration names them
(``RegisterKV.abandoned``) and they are refused here until their engine's last deadline for
them has passed (their own ``expires_unix`` refuses them after that).
"""

from __future__ import annotations

import time


class Abandoned:
    """(engine, req_id) pairs refused until a moment; every entry expires by itself."""

    def __init__(self) -> None:
        self._until: dict[tuple[str, str], float] = {}

    def add(self, engine: str, req_ids: list[str], for_s: float) -> None:
        now = time.monotonic()
        for key, until in list(self._until.items()):
            if until <= now:
                del self._until[key]
        until = now + for_s
        for req_id in req_ids:
            self._until[(engine, req_id)] = max(until, self._until.get((engine, req_id), 0.0))

    def __contains__(self, key: tuple[str, str]) -> bool:
        return bool(self._until) and self._until.get(key, 0.0) > time.monotonic()
