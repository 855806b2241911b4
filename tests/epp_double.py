"""TEST DOUBLE of the Endpoint Picker's `Picker` protocol (gateway/epp/server.py), for the EPP
transport tests only. It is NOT warmroute's picker: it authenticates nobody, tokenizes nothing
and knows no cache. It puts a fixed `cache_salt` into the body (so a test can see the mutation
reach the engine), answers a fixed endpoint order (filtered by the subset hint), and records
every call so tests can assert on what the transport delivered."""
from __future__ import annotations

import asyncio
import json
from typing import Any, Mapping, Sequence

from gateway.epp.extproc import Outcome, Pick, Reject
from gateway.errors import ApiError

__all__ = ["StaticPickerDouble"]


class StaticPickerDouble:
    def __init__(self, endpoints: Sequence[str], *, salt: str = "salt-from-the-picker-double",
                 reject: Reject | None = None, delay_s: float = 0.0) -> None:
        self.endpoints = list(endpoints)  # answered in this order (primary first)
        self.salt = salt  # written as the body's cache_salt, replacing the client's
        self.reject = reject  # when set, every request gets it
        self.delay_s = delay_s  # simulated decision time
        self.picks: list[tuple[dict, bytes, tuple | None]] = []  # (headers, body, subset) per pick() call
        self.outcomes: list[tuple[Any, Outcome]] = []  # (ctx, outcome) per observe() call
        self.observed = asyncio.Event()

    async def pick(self, headers: Mapping[str, str], body: bytes, subset: Sequence[str] | None) -> Pick | Reject:
        self.picks.append((dict(headers), body, tuple(subset) if subset is not None else None))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.reject is not None:
            return self.reject
        payload = None
        if body:
            try:
                payload = json.loads(body)
            except ValueError:
                raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
        if isinstance(payload, dict):
            payload["cache_salt"] = self.salt
            body = json.dumps(payload).encode()
        order = [e for e in self.endpoints if subset is None or e in subset]
        return Pick(body=body, endpoints=order, ctx={"n": len(self.picks)}, remove_headers=["authorization"])

    def observe(self, ctx: Any, outcome: Outcome) -> None:
        self.outcomes.append((ctx, outcome))
        self.observed.set()
