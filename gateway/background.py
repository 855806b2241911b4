"""The gateway's background loops (started by gateway.server, cancelled at close; never by a
constructor), and how they report trouble.

- `run_index_sync`: keeps the KV index current from the feed (gateway.index_sync), restarting it
  with backoff when the feed fails.
- `run_inflight_exchange`: every `inflight_poll_s`, adds this gateway's in-flight changes to the
  feed's shared counters, sets its dispatch gauges (gateway.load: routed rates and request sizes per
  replica) and its requests' LoRA adapters per replica, and reads everyone's, in one round trip
  (`exchange_inflight`: so active-active gateways see each other's load, and each exchange refreshes
  our counters' TTL, after which a killed gateway's stop weighing on the replicas); then trades
  copies in progress with the other gateways (`exchange_copies`, gateway.routing: a second round
  trip) and, for a policy that shares them (cache_plan), placements (`exchange_placements`: a third,
  which also carries keep-alive's refreshes and gives both to this gateway's `retainer`:
  gateway.keepalive, `touched`); every QUIET_EXCHANGE_S instead while no other gateway has anything
  in flight, unless keep-alive keeps something here and other gateways' records arrived within its
  forget_s (idle CPU: each exchange wakes Redis and this process), and every `flow.busy_exchange_s`
  while flow control holds requests here or at another gateway (`busy`: a saturated pool, where a
  grant the others see late fills a slot twice; the counters only, copies and placements keep
  `inflight_poll_s`). Counters the feed lost (Redis restarted empty, or our key expired while it was
  unreachable) are noticed in the exchange's reply and published again whole; changes a failed
  exchange did not apply are sent again with the next one.
- `run_share_exchange`: every `flow.share_interval_s` (`flow.busy_exchange_s` while requests are
  held here or at another gateway; QUIET_EXCHANGE_S while no other gateway was on the board at
  the last exchange), flow control's row on the fair-share board out and the other gateways' rows
  in (gateway.flow_share: what they mean); when the board fails, flow control runs on its local
  share and the loop retries once a second.
- `run_keys_reload`: re-reads the API-keys file when its mtime changes (keeps the old keys if the
  new file is invalid).
- `discover_model` / `run_model_discovery`: the model name and context length from the replicas'
  `/v1/models` when config does not give them.
- `refresh_adapters` / `run_adapter_discovery`: every `model.lora_discovery_s`, the LoRA adapters
  each replica's `/v1/models` lists with the model as their parent (gateway.model: where a request
  for one may go).
- `run_keep_alive`: every quarter of `keep_alive.idle_s` (at most 1 s), sends the refreshes the
  retainer says are due (gateway.keepalive) to replicas that are up (each queued for the other
  gateways, `routing.refreshed`, whose retainers count it as a use), each its own task bounded by
  `timeout_s` (at most MAX_REFRESHES_IN_FLIGHT at once; beyond, the rest wait for the next check),
  and tells the retainer when each is over, so it hands out the next (its `max_in_flight` per
  replica); a replica that left is forgotten; one that refuses the refreshes' priority gets them
  without it for a while (gateway.rewrite.refuses_priority, a warning logged). A refresh is not a
  client's request: no flow control, no place in the routing load's in-flight counts, no retry.
A failing dependency is logged once when it fails, then at most once a minute with the count, and
once when it recovers (replica_agent.feed.FailureLog): a Redis outage is a few lines, not one per
second.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable

import aiohttp

from gateway.auth import ApiKeyStore, Authenticator, file_mtime, load_api_keys_file, parse_key_entry
from gateway.config import AuthConfig, KeepAliveConfig
from gateway.index import KVIndex
from gateway.index_sync import IndexSync
from gateway.keepalive import REFRESH_PRIORITY, Retainer, refresh_body, refresh_computed_tokens
from gateway.load import LoadTracker
from gateway.membership import Membership
from gateway.model import ModelInfo
from gateway.rewrite import PRIORITY_RETRY_S, PriorityRefusals, refuses_priority
from replica_agent.feed import FailureLog, FairShareBoard, InflightBoard

if TYPE_CHECKING:
    from gateway.flow import FlowControl
    from gateway.routing import RoutingState
    from policies.base import Policy

__all__ = ["trouble", "run_index_sync", "run_inflight_exchange", "run_keys_reload", "discover_model",
           "refresh_adapters", "run_adapter_discovery",
           "run_model_discovery", "run_keep_alive", "keep_alive_check_s", "MAX_REFRESHES_IN_FLIGHT"]

log = logging.getLogger("warmroute.gateway")

MAX_REFRESHES_IN_FLIGHT = 64


def trouble(what: str) -> FailureLog:
    """The failure log of one of the gateway's dependencies (module header)."""
    return FailureLog(log, what)


async def run_index_sync(sync: IndexSync, health: FailureLog) -> None:
    backoff = 0.5
    while True:
        try:
            await sync.run()  # it reports outages it rides out to `health` itself
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            health.failed(exc)
            await asyncio.sleep(backoff)
            backoff = min(10.0, backoff * 2)


QUIET_EXCHANGE_S = 1.0  # the exchange period while no other gateway has work in flight


async def run_inflight_exchange(board: InflightBoard, load: LoadTracker, health: FailureLog, period_s: float, *,
                                routing: "RoutingState | None" = None, policy: "Policy | None" = None,
                                busy: Callable[[], bool] | None = None, busy_period_s: float | None = None,
                                retainer: Retainer | None = None) -> None:
    traded = 0.0  # when copies and placements were last traded (monotonic)
    while True:
        # keep-alive with other gateways around (their records heard within forget_s): trade at once
        keeping = (retainer is not None and routing is not None and retainer.keeping()
                   and routing.clock() - routing.others_heard_at <= retainer.ka.forget_s)
        await asyncio.sleep(_inflight_period(load, period_s, busy, busy_period_s, keeping=keeping))
        pending = load.take_pending()
        try:
            try:
                got = await board.exchange_inflight(pending, load.gauges(time.monotonic()), load.adapters())
            except BaseException:
                load.restore_pending(pending)  # not applied (as far as we know): sent again next time
                raise
            shared = {rid: (v.reqs, v.prefill_tokens, v.open_reqs, v.routed_rps, v.size_weight, v.size_tokens,
                            v.lora_running, v.lora_wanting) for rid, v in got.items()}
            if load.lost_by_feed(shared):
                # the feed had none of ours before this exchange: it holds `pending` of ours now
                log.warning("the feed lost this gateway's in-flight counters: publishing them again")
                load.rebase(held=pending)
            load.set_shared(shared)
            now = time.monotonic()
            # copies in progress, both ways (gateway.routing), at most every `period_s` (the busy
            # period quickens the counters only); lost on a failure: they only matter for the
            # seconds until the engines' events say the same
            if routing is not None and now - traded >= 0.9 * period_s:
                traded = now
                routing.apply_shared(await board.exchange_copies(routing.take_shared()))
                if policy is not None and getattr(policy, "shares_placements", False):  # the plan's inputs
                    got = await board.exchange_placements(routing.take_placements())
                    routing.apply_placements(policy, got, retainer, time.monotonic())
            health.ok()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            health.failed(exc)
            await asyncio.sleep(1.0)


def _inflight_period(load: LoadTracker, period_s: float, busy: Callable[[], bool] | None,
                     busy_period_s: float | None, *, keeping: bool = False) -> float:
    if busy is not None and busy_period_s and busy():  # flow control holds requests somewhere: the pool is saturated
        return min(period_s, busy_period_s)
    # while the other gateways have nothing in flight (or there are none), a slower exchange:
    # their first requests then weigh on our view at most QUIET_EXCHANGE_S late; not while
    # keep-alive keeps roots and other gateways are around (`keeping`): refreshes must reach
    # the others within the retainer's defer_s, or every gateway refreshes them (gateway.keepalive)
    return period_s if keeping or load.others_active() else max(period_s, QUIET_EXCHANGE_S)


async def flush_inflight(board: InflightBoard, load: LoadTracker) -> dict:
    """Add our pending in-flight changes to the shared counters; what was flushed. On a failure
    the changes not applied go back to pending (a lost decrement would count a request forever)."""
    pending = load.take_pending()
    left = dict(pending)
    try:
        for rid, change in pending.items():
            await board.incr_inflight(rid, *change)
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
            cards = await _model_cards(session, st.url)
            if not cards:
                continue
            card = cards[0]  # vLLM lists the model first, then its LoRA adapters (parent: the model)
            name = model.name or card.get("id")
            mml = card.get("max_model_len")
            if isinstance(name, str) and name:
                model.set(name, mml if isinstance(mml, int) else None)
                model.set_listed(st.replica_id, _adapters_of(cards, name))
                if model.max_model_len is not None:
                    return
        if model.known and model.max_model_len is not None:
            return
        if i + 1 < attempts:
            await asyncio.sleep(0.3)
    if model.known and model.max_model_len is None and fallback_max_model_len and 0 < fallback_max_model_len < 10_000_000:
        model.max_model_len = fallback_max_model_len


def _adapters_of(cards: list[dict], model_name: str) -> list:
    """The LoRA adapters in a /v1/models listing: the cards whose parent is the model."""
    return [c.get("id") for c in cards if c.get("parent") == model_name]


async def refresh_adapters(session: aiohttp.ClientSession, membership: Membership, model: ModelInfo) -> None:
    """Each replica's LoRA adapters as its /v1/models lists them now (a replica that does not
    answer keeps its last listing: a slow probe is not an unloaded adapter)."""
    if not model.known:
        return
    states = membership.all()
    listings = await asyncio.gather(*(_model_cards(session, st.url) for st in states))
    for st, cards in zip(states, listings):
        if cards is not None and membership.get(st.replica_id) is not None:
            model.set_listed(st.replica_id, _adapters_of(cards, model.name))


async def run_adapter_discovery(session: aiohttp.ClientSession, membership: Membership, model: ModelInfo,
                                period_s: float) -> None:
    while True:
        await asyncio.sleep(period_s)
        await refresh_adapters(session, membership, model)


async def _model_cards(session: aiohttp.ClientSession, base_url: str) -> list[dict] | None:
    try:
        async with session.get(base_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=2)) as r:
            if r.status != 200:
                return None
            data = await r.json()
        cards = data.get("data")
        return [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError, TypeError):
        return None


async def run_model_discovery(session: aiohttp.ClientSession, membership: Membership, model: ModelInfo,
                              fallback_max_model_len: int | None) -> None:
    while not model.known or model.max_model_len is None:
        await discover_model(session, membership, model, fallback_max_model_len=fallback_max_model_len)
        await asyncio.sleep(2.0)


def keep_alive_check_s(idle_s: float) -> float:
    """How often `run_keep_alive` asks the retainer what is due: a quarter of `idle_s`, at most 1 s."""
    return min(1.0, idle_s / 4)


async def run_keep_alive(retainer: Retainer, cfg: KeepAliveConfig, *, session: aiohttp.ClientSession,
                         membership: Membership, index: KVIndex, model: ModelInfo, metrics, health: FailureLog,
                         routing: "RoutingState | None" = None) -> None:
    period = keep_alive_check_s(cfg.idle_s)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    bs = model.block_size
    pending: set = set()
    refusals = PriorityRefusals()  # replicas that refused the refreshes' priority lately

    async def refresh(rid: str, url: str, body: dict, rf) -> None:
        try:
            async with session.post(url + "/v1/completions", json=body, timeout=timeout) as r:
                raw = await r.read()
                ok = r.status == 200
            refused = not ok and "priority" in body and refuses_priority(r.status, raw)
            if refused and refusals.refused(rid, time.monotonic()):
                log.warning("replica %s refuses request priorities (vLLM without --scheduling-policy priority): "
                            "its keep-alive refreshes go without one for %.0f s", rid, PRIORITY_RETRY_S)
            if not ok:
                raise RuntimeError(f"replica {rid} answered a refresh with HTTP {r.status}")
            computed = refresh_computed_tokens(raw, len(body["prompt"]))
            metrics.child(metrics.refresh_computed, rid).inc(computed)
            metrics.child(metrics.refreshes, rid, "partial" if computed > bs else "ok").inc()
            if computed > bs:
                log.debug("keep-alive refresh on %s computed %d of %d prompt tokens", rid, computed, len(body["prompt"]))
            health.ok()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed refresh is counted and logged, nothing else
            metrics.child(metrics.refreshes, rid, "error").inc()
            health.failed(exc)
        finally:
            retainer.done(rf)

    try:
        while True:
            await asyncio.sleep(period)
            for rid in [rid for rid in retainer.kept if membership.get(rid) is None]:
                retainer.forget(rid)
            if not model.name or len(pending) >= MAX_REFRESHES_IN_FLIGHT:
                continue
            now = membership.clock()
            for rf in retainer.due(time.monotonic(), index.gpu_run, index.kv_capacity_blocks, index.waiting_reqs):
                st = membership.get(rf.replica)
                if st is None or not st.available(now) or len(pending) >= MAX_REFRESHES_IN_FLIGHT:
                    retainer.done(rf)  # not sent: due again at a later check
                    continue
                ids, salt, lora = rf.payload
                prio = cfg.engine_priority and refusals.allows(st.replica_id, time.monotonic())
                body = refresh_body(lora or model.name, ids, len(rf.keys), bs, salt,
                                    priority=REFRESH_PRIORITY if prio else None)
                task = asyncio.create_task(refresh(st.replica_id, st.url, body, rf))
                if routing is not None:
                    routing.refreshed(st.replica_id, rf.kept, retainer.rank)  # the other gateways count it as a use
                pending.add(task)
                task.add_done_callback(pending.discard)
    finally:
        for task in list(pending):
            task.cancel()


async def run_share_exchange(flow: FlowControl, board: FairShareBoard, health: FailureLog, period_s: float,
                             busy_period_s: float | None = None) -> None:
    """Exchange rows with the other gateways every `period_s`, every `busy_period_s` while flow
    control is contended (module rules)."""
    flow.peers.has_board = True
    flow.peers.owner = str(getattr(board, "owner", ""))
    while True:
        try:
            others = await board.exchange_shares(flow.share_row())
            flow.apply_shares(others)
            health.ok()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            health.failed(exc)
            flow.board_lost()
            await asyncio.sleep(max(period_s, 1.0))
            continue
        await asyncio.sleep(_share_period(flow, period_s, busy_period_s))


def _share_period(flow: FlowControl, period_s: float, busy_period_s: float | None) -> float:
    if busy_period_s and flow.contended():
        return min(period_s, busy_period_s)
    # Alone on the board at the last exchange: nobody reads our row but a gateway that starts, and
    # it reads it at its first exchange; we hear of it at most QUIET_EXCHANGE_S late, as the
    # in-flight exchange does (idle CPU: each exchange is a Redis round trip, ~0.4 ms here)
    if flow.peers.shared and flow.peers.n_gateways == 1:
        return max(period_s, QUIET_EXCHANGE_S)
    return period_s
