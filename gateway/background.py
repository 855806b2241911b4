"""The gateway's background loops (started by gateway.server, cancelled at close; never by a
constructor), and how they report trouble.

- `run_index_sync`: keeps the KV index current from the feed (gateway.index_sync), restarting it
  with backoff when the feed fails.
- `run_inflight_exchange`: every `inflight_poll_s`, adds this gateway's in-flight changes to the
  feed's shared counters and reads everyone's (so active-active gateways see each other's load);
  a zero increment every `beat_s` (a third of the counters' TTL, at most 10 s) keeps our counters
  alive while idle, and a killed gateway's stop weighing on the replicas after that TTL. Counters
  the feed lost (Redis restarted empty) are noticed on the next read and published again whole;
  changes a failed flush did not apply are flushed again.
- `run_keys_reload`: re-reads the API-keys file when its mtime changes (keeps the old keys if the
  new file is invalid).
- `discover_model` / `run_model_discovery`: the model name and context length from the replicas'
  `/v1/models` when config does not give them.
A failing dependency is logged once when it fails, then at most once per `Trouble.every_s` with
the count, and once when it recovers: a Redis outage is a few lines, not one per second.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Callable

import aiohttp

from gateway.auth import ApiKeyStore, Authenticator, load_api_keys_file, parse_key_entry
from gateway.config import AuthConfig
from gateway.index_sync import IndexSync
from gateway.load import LoadTracker
from gateway.membership import Membership
from gateway.model import ModelInfo
from replica_agent.feed import InflightBoard

__all__ = ["Trouble", "run_index_sync", "run_inflight_exchange", "run_keys_reload", "discover_model",
           "run_model_discovery", "file_mtime"]

log = logging.getLogger("warmroute.gateway")


class Trouble:
    """The health of one dependency, logged without flooding (module header)."""

    def __init__(self, what: str, *, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what  # e.g. "feed (index sync)"
        self.every_s = every_s  # at most one repeat line per this many seconds
        self.clock = clock
        self.ok = False  # False until the first success
        self.failures = 0  # consecutive failures
        self.total_failures = 0  # failures ever (a metric)
        self._since = 0.0  # clock() of the first failure of this run
        self._logged = -1e18  # clock() of the last warning

    def failed(self, exc: BaseException) -> None:
        now = self.clock()
        self.ok = False
        if self.failures == 0:
            self._since = now
        self.failures += 1
        self.total_failures += 1
        if self.failures == 1 or now - self._logged >= self.every_s:
            self._logged = now
            log.warning(f"{self.what} unavailable: {exc}", extra={"fields": {
                "failures": self.failures, "for_s": round(now - self._since, 1)}})

    def succeeded(self) -> None:
        if self.failures:
            log.info(f"{self.what} recovered", extra={"fields": {
                "failures": self.failures, "after_s": round(self.clock() - self._since, 1)}})
        self.ok = True
        self.failures = 0


async def run_index_sync(sync: IndexSync, trouble: Trouble) -> None:
    backoff = 0.5
    while True:
        try:
            trouble.ok = True  # IndexSync retries short outages itself; a raise is a long one
            await sync.run()
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            trouble.failed(exc)
            await asyncio.sleep(backoff)
            backoff = min(10.0, backoff * 2)


async def run_inflight_exchange(board: InflightBoard, load: LoadTracker, membership: Membership, trouble: Trouble,
                                period_s: float, *, beat_s: float = 10.0) -> None:
    last_beat = time.monotonic()
    while True:
        await asyncio.sleep(period_s)
        try:
            # Read, then flush: the counters read still hold exactly what we flushed before, so a
            # shortfall means the feed lost ours (load.lost_by_feed) and we publish them again whole.
            got = await board.inflight()
            shared = {rid: (v.reqs, v.prefill_tokens) for rid, v in got.items()}
            if load.lost_by_feed(shared):
                log.warning("the feed lost this gateway's in-flight counters: publishing them again")
                load.rebase()
            load.set_shared(shared)
            pending = await flush_inflight(board, load)
            if time.monotonic() - last_beat > beat_s:
                last_beat = time.monotonic()
                for rid in membership.ids():
                    if rid not in pending:
                        await board.incr_inflight(rid, 0, 0)
            trouble.succeeded()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            trouble.failed(exc)
            await asyncio.sleep(1.0)


async def flush_inflight(board: InflightBoard, load: LoadTracker) -> dict:
    """Add our pending in-flight changes to the shared counters; what was flushed. On a failure
    the changes not applied go back to pending (a lost decrement would count a request forever)."""
    pending = load.take_pending()
    left = dict(pending)
    try:
        for rid, (r, t) in pending.items():
            await board.incr_inflight(rid, r, t)
            del left[rid]
    except BaseException:
        load.restore_pending(left)
        raise
    return pending


async def run_keys_reload(auth: Authenticator, cfg: AuthConfig) -> None:
    path = cfg.api_keys_file
    mtime = file_mtime(path)
    while True:
        await asyncio.sleep(cfg.api_keys_reload_s)
        mt = file_mtime(path)
        if not mt or mt == mtime:
            continue
        try:
            tenants: dict[str, list[bytes]] = {}
            for t, keys in cfg.api_keys.items():
                tenants.setdefault(t, []).extend(parse_key_entry(k, allow_plain=False) for k in keys)
            for t, ds in load_api_keys_file(path).items():
                tenants.setdefault(t, []).extend(ds)
            auth.replace_keys(ApiKeyStore(tenants))
            mtime = mt
            log.info("api keys reloaded", extra={"fields": {"tenants": len(tenants)}})
        except Exception as exc:  # noqa: BLE001 - keep the old keys
            log.error("api keys file invalid, keeping the previous keys: %s", exc)


async def discover_model(session: aiohttp.ClientSession, membership: Membership, model: ModelInfo, *,
                         attempts: int = 1, fallback_max_model_len: int | None = None) -> None:
    """Ask the replicas' /v1/models for the model's name and context length (module header)."""
    for i in range(attempts):
        for st in membership.all():
            card = await _model_card(session, st.url)
            if card is None:
                continue
            name = model.name or card.get("id")
            mml = card.get("max_model_len")
            if isinstance(name, str) and name:
                model.set(name, mml if isinstance(mml, int) else None)
                if model.max_model_len is not None:
                    return
        if model.known and model.max_model_len is not None:
            return
        if i + 1 < attempts:
            await asyncio.sleep(0.3)
    if model.known and model.max_model_len is None and fallback_max_model_len and 0 < fallback_max_model_len < 10_000_000:
        model.max_model_len = fallback_max_model_len


async def _model_card(session: aiohttp.ClientSession, base_url: str) -> dict | None:
    try:
        async with session.get(base_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=2)) as r:
            if r.status != 200:
                return None
            data = await r.json()
        card = (data.get("data") or [{}])[0]
        return card if isinstance(card, dict) else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError, TypeError, IndexError):
        return None


async def run_model_discovery(session: aiohttp.ClientSession, membership: Membership, model: ModelInfo,
                              fallback_max_model_len: int | None) -> None:
    while not model.known or model.max_model_len is None:
        await discover_model(session, membership, model, fallback_max_model_len=fallback_max_model_len)
        await asyncio.sleep(2.0)


def file_mtime(path: str | None) -> float:
    try:
        return os.stat(path).st_mtime if path else 0.0
    except OSError:
        return 0.0
