"""LoRA adapters the gateway has not heard of yet, looked up when a request names one, and ones a
replica has unloaded since it listed them.

Rules: discovery (gateway.background.refresh_adapters, every `model.lora_discovery_s`) learns the
adapters each replica's `/v1/models` lists; an adapter loaded at run time (`/v1/load_lora_adapter`)
would be refused (404) until the next round. So a request for a name the gateway does not serve,
while discovery is on, first asks the replicas again (`find`) and is refused only if none lists
it then. One look at a time (requests meanwhile wait for the same one), and none sooner than
MIN_INTERVAL_S after the last ended: a client sending made-up names costs each replica at most
one `/v1/models` a second, and waits at most that look (its answers are bounded at 2 s).
A replica that answers 404 for an adapter it listed has unloaded it since (`not_loaded`): its
listing drops the adapter until a later look lists it there again. The HTTP gateway's dispatch
then tries the next ranked replica (gateway.dispatch); behind Envoy the picker learns it from the
response (gateway.epp.picker) and the client gets the 404.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from gateway.model import ModelInfo

__all__ = ["AdapterLookup", "MIN_INTERVAL_S", "not_loaded"]

MIN_INTERVAL_S = 1.0  # at most one look this often (module rule)

log = logging.getLogger("warmroute.gateway")


class AdapterLookup:
    def __init__(self, model: ModelInfo, refresh: Callable[[], Awaitable[None]], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self._refresh = refresh  # asks every replica's /v1/models and updates `model` (gateway.background)
        self._clock = clock
        self._running: asyncio.Task | None = None
        self._last_end = float("-inf")
        self.looks = 0  # looks made (what tests count)

    async def find(self, name: str) -> bool:
        """Whether `name` is served after a look (module rule); False without looking when a look
        ended less than MIN_INTERVAL_S ago."""
        if name in self.model.served:
            return True
        if self._running is None:
            if self._clock() - self._last_end < MIN_INTERVAL_S:
                return False
            self.looks += 1
            self._running = asyncio.ensure_future(self._look())
        await asyncio.shield(self._running)  # a cancelled request does not cancel the others' look
        return name in self.model.served

    async def _look(self) -> None:
        before = self.model.adapters
        try:
            await self._refresh()
        except Exception:  # noqa: BLE001 - a failed look refuses the name (404), never the request (500)
            log.exception("looking up LoRA adapters failed")
        finally:
            self._last_end = self._clock()
            self._running = None
        if new := sorted(self.model.adapters - before):  # names the replicas list, never a client's
            log.info("LoRA adapters found when a request named one: %s", ", ".join(new))


def not_loaded(model: ModelInfo, replica_id: str, lora: str | None) -> bool:
    """`replica_id` answered 404 for a request running `lora`: dropped from its listing if it
    listed it (module rules). Whether it was."""
    if lora is None or not model.unlist(replica_id, lora):
        return False
    log.warning("replica %s answered 404 for LoRA adapter %s, which it listed: no longer sent there until "
                "its /v1/models lists it again", replica_id, lora)
    return True
