"""The replica agent (`warmroute agent`): engine KV events + load -> the feed, for one replica.

Rule: the agent's published stream always describes its translator's state. Every change goes
through one lock: translate a batch, publish its records, and (periodically) write a snapshot of
the full key set at the last published offset, so a snapshot is never ahead of or behind the
stream. When the agent cannot trust what it published, it resynchronises:
  - the engine says so (sequencer `Resync`: unreplayable gap, engine restart): drop the translator
    state, publish "cleared" and an empty snapshot, relearn from the events that follow;
  - the feed lost records (a publish failed, or the feed's last offset went below ours: Redis
    restarted empty): publish hello + "cleared" + the full key set (in chunks) + a snapshot.
Engine events are consumed continuously even while the feed is down (a stalled subscriber can
block the engine's loop): records are dropped then, and the full republish repairs the feed.
Startup: resolve the model name (config, else the engine's /v1/models), publish hello + "cleared"
(a previous agent's state is stale), then run the event, load and snapshot tasks. The load task
publishes a "load" record per scrape (or a bare heartbeat without an engine URL); a replica whose
engine cannot be scraped publishes none and goes stale in the gateways' indexes. `/healthz` and
`/metrics` are served on the admin port. A scrape that keeps failing is logged once a minute, and
once when it recovers (feed.FailureLog). `main_from_args` stops on SIGTERM/SIGINT in every
state: while waiting for the engine's /v1/models, with the engine or the feed unreachable, running.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field

from .decode import BlockStored, EngineDecodeError, decode_payload
from .feed.base import Feed, FeedUnavailable, open_feed
from .feed.records import MEDIUM_GPU, FeedEvent, Hello, LoadReport, Snapshot
from .feed import FailureLog
from .scraper import Scraper
from .translate import Cleared, KeysRemoved, KeysStored, Translator
from .transport import Deliver, EngineStream, Resync

__all__ = ["AgentConfig", "AgentStats", "RunningAgent", "main_from_args", "start_agent"]

log = logging.getLogger("warmroute.agent")


@dataclass(frozen=True, slots=True)
class AgentConfig:
    replica_id: str  # this replica's id, as the gateway names it
    kv_events_endpoint: str  # engine's ZMQ PUB endpoint
    engine_url: str | None = None  # engine HTTP base URL (load scraping, model name); None: no scraping
    replay_endpoint: str | None = None  # engine's ZMQ ROUTER replay endpoint
    bind: bool = False  # bind the SUB socket (engine connects)
    topic: str = ""  # ZMQ topic prefix to subscribe to ("" = all)
    model: str | None = None  # served model name (key root); None: from the engine's /v1/models
    block_size: int = 0  # tokens per block; 0: from events / cache_config_info
    load_interval_s: float = 1.0  # engine /metrics scrape period
    live_ttl_s: float = 10.0  # liveness key TTL on the feed
    snapshot_interval_s: float = 5.0  # snapshot at most this often when keys changed
    snapshot_every_records: int = 20_000  # ... and at least every this many records
    chunk_keys: int = 4096  # keys per record when republishing the full set
    replay_timeout_s: float = 5.0  # wait for a replay reply
    feed_retry_s: float = 0.5  # first back-off after a feed failure (doubles up to 5 s)
    admin_host: str = "127.0.0.1"  # /healthz and /metrics
    admin_port: int | None = None  # None: no admin server; 0: any free port


@dataclass(slots=True)
class AgentStats:
    batches: int = 0  # engine batches delivered
    decode_errors: int = 0  # payloads that could not be decoded
    skipped_events: int = 0  # events of unknown type
    records_published: int = 0
    feed_errors: int = 0
    feed_republishes: int = 0  # full republishes after feed loss
    engine_resyncs: int = 0  # resyncs asked by the sequencer (or by a /metrics counter reset)
    metrics_restarts: int = 0  # engine restarts seen as /metrics counters going backwards
    snapshots: int = 0
    load_scrapes: int = 0
    load_errors: int = 0
    last_offset: int = 0  # last offset published
    last_batch_engine_ts: float = 0.0  # engine wall clock of the last batch
    last_batch_lag_s: float = 0.0  # agent receive time - engine batch ts, last batch
    last_resync_reason: str = ""
    started_at: float = field(default_factory=time.time)


class RunningAgent:
    """A started agent; `await close()` stops every task and socket it owns."""

    def __init__(self, cfg: AgentConfig, feed: Feed) -> None:
        self.cfg = cfg
        self.feed = feed
        self.epoch = uuid.uuid4().hex[:16]
        self.stats = AgentStats()
        self.model: str = cfg.model or ""
        self.translator: Translator | None = None
        self.stream = EngineStream(cfg.kv_events_endpoint, bind=cfg.bind, replay_endpoint=cfg.replay_endpoint,
                                   topic=cfg.topic, replay_timeout_s=cfg.replay_timeout_s)
        self.scraper = Scraper(cfg.engine_url) if cfg.engine_url else None
        self._scrape_log = FailureLog(log, f"load scrape of {self.scraper.url}") if self.scraper else None
        self.last_load: LoadReport | None = None
        self.admin_url: str | None = None
        self._lock = asyncio.Lock()
        self._dirty = False  # the feed may have lost records: republish everything
        self._retry_at = 0.0
        self._retry_s = 0.0  # current feed retry back-off
        self._keys_changed = False
        self._records_since_snapshot = 0
        self._last_snapshot_at = 0.0
        self._tasks: list[asyncio.Task] = []
        self._restarts_at_scrape = 0  # sequencer restarts seen when the last successful scrape began
        self._runner = None
        self._closed = False

    # ---------------------------------------------------------------- lifecycle
    async def _start(self) -> None:
        self.stream.open()  # bind/connect before anything else so no early batch is lost
        if not self.model:
            self.model = await self._model_from_engine()
        self.translator = Translator(self.model, self.cfg.block_size)
        if self.scraper is not None:
            try:
                await self._scrape_once()
            except Exception as exc:  # the engine may still be starting
                self._scrape_log.failed(_describe(exc))
        async with self._lock:
            await self._publish([self._hello(), FeedEvent(self.cfg.replica_id, 0, "cleared")])
            await self._snapshot_locked()
        self._tasks = [asyncio.create_task(self._events_task(), name=f"agent-events-{self.cfg.replica_id}"),
                       asyncio.create_task(self._snapshot_task(), name=f"agent-snapshots-{self.cfg.replica_id}")]
        self._tasks.append(asyncio.create_task(self._load_task(), name=f"agent-load-{self.cfg.replica_id}"))
        if self.cfg.admin_port is not None:
            await self._start_admin()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        if self._runner is not None:
            await self._runner.cleanup()
        if self.scraper is not None:
            await self.scraper.close()
        self.stream.close()

    def healthy(self) -> bool:
        return bool(self._tasks) and all(not t.done() for t in self._tasks)

    async def _model_from_engine(self) -> str:
        if not self.cfg.engine_url:
            raise ValueError("the agent needs --model or --engine-url (to read the served model name)")
        import aiohttp

        url = self.cfg.engine_url.rstrip("/") + "/v1/models"
        delay = 0.2
        waiting = FailureLog(log, f"waiting for the engine: GET {url}")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as s:
            while True:
                try:
                    async with s.get(url) as resp:
                        data = await resp.json()
                        model = str(data["data"][0]["id"])
                    waiting.ok()
                    return model
                except Exception as exc:
                    waiting.failed(_describe(exc))
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)

    def _hello(self) -> FeedEvent:
        bs = self.cfg.block_size or (self.translator.block_size if self.translator else 0)
        return FeedEvent(self.cfg.replica_id, 0, "hello", hello=Hello(bs, self.model, self.epoch))

    # ---------------------------------------------------------------- publishing (lock held)
    async def _publish(self, drafts: list[FeedEvent]) -> None:
        if self._dirty:
            if time.monotonic() < self._retry_at:
                return
            try:
                await self._republish_full_locked()
            except FeedUnavailable as exc:
                self._feed_failed(exc)
                return
        if not drafts:
            return
        try:
            published = await self.feed.publish(self.cfg.replica_id, drafts)
        except FeedUnavailable as exc:
            self._feed_failed(exc)
            return
        self.stats.records_published += len(published)
        self.stats.last_offset = published[-1].offset
        self._records_since_snapshot += len(published)

    def _feed_failed(self, exc: Exception) -> None:
        self.stats.feed_errors += 1
        if not self._dirty:
            log.warning("feed publish failed (%s): will republish the full state when it is back", exc)
        self._dirty = True
        # back off (up to 5 s) so an unreachable feed does not slow the consumption of engine events
        self._retry_s = min(5.0, self._retry_s * 2) if self._retry_s else self.cfg.feed_retry_s
        self._retry_at = time.monotonic() + self._retry_s

    async def _republish_full_locked(self) -> None:
        assert self.translator is not None
        rid = self.cfg.replica_id
        drafts = [self._hello(), FeedEvent(rid, 0, "cleared")]
        n = self.cfg.chunk_keys
        for medium, keys in self.translator.keys_by_medium().items():
            for i in range(0, len(keys), n):
                drafts.append(FeedEvent(rid, 0, "stored", keys[i : i + n], medium))
        published = await self.feed.publish(rid, drafts)
        self.stats.last_offset = published[-1].offset
        self.stats.records_published += len(published)
        self._dirty = False
        self._retry_s = 0.0
        self.stats.feed_republishes += 1
        await self._snapshot_locked()
        log.info("republished %d records of full state for %s", len(published), rid)

    async def _snapshot_locked(self) -> None:
        if self._dirty or self.translator is None:
            return
        snap = Snapshot(self.cfg.replica_id, self.stats.last_offset, self.translator.keys_by_medium(), time.time())
        try:
            await self.feed.write_snapshot(snap)
        except FeedUnavailable as exc:
            self._feed_failed(exc)
            return
        self.stats.snapshots += 1
        self._keys_changed = False
        self._records_since_snapshot = 0
        self._last_snapshot_at = time.monotonic()

    # ---------------------------------------------------------------- tasks
    async def _events_task(self) -> None:
        rid = self.cfg.replica_id
        async for act in self.stream:
            if isinstance(act, Resync):
                self.stats.engine_resyncs += 1
                self.stats.last_resync_reason = act.reason
                log.warning("resync %s: %s", rid, act.reason)
                async with self._lock:
                    self.translator.reset()
                    await self._publish([FeedEvent(rid, 0, "cleared")])
                    await self._snapshot_locked()
                continue
            assert isinstance(act, Deliver)
            try:
                batch = decode_payload(act.payload)
            except EngineDecodeError as exc:
                self.stats.decode_errors += 1
                log.warning("undecodable batch seq %d: %s", act.seq, exc)
                continue
            self.stats.batches += 1
            self.stats.skipped_events += batch.skipped
            if not self.translator.block_size:
                bs = next((e.block_size for e in batch.events if type(e) is BlockStored and e.block_size), 0)
                if bs:  # learnt from the engine: tell the gateways
                    self.translator.block_size = bs
                    async with self._lock:
                        await self._publish([self._hello()])
            self.stats.last_batch_engine_ts = batch.ts
            self.stats.last_batch_lag_s = max(0.0, time.time() - batch.ts) if batch.ts else 0.0
            async with self._lock:
                drafts = _feed_drafts(rid, self.translator.apply_all(batch.events))
                if drafts:
                    self._keys_changed = True
                    await self._publish(drafts)
                    if self._records_since_snapshot >= self.cfg.snapshot_every_records:
                        await self._snapshot_locked()

    async def _snapshot_task(self) -> None:
        while True:
            await asyncio.sleep(min(self.cfg.snapshot_interval_s, 1.0))
            try:
                async with self._lock:
                    if self._dirty:
                        await self._publish([])  # retries the full republish when due
                        continue
                    if await self.feed.last_offset(self.cfg.replica_id) < self.stats.last_offset:
                        log.warning("feed lost our records (wiped): republishing the full state")
                        self._dirty = True
                        await self._publish([])
                        continue
                    due = time.monotonic() - self._last_snapshot_at >= self.cfg.snapshot_interval_s
                    if due and self._keys_changed:
                        await self._snapshot_locked()
            except FeedUnavailable as exc:
                self._feed_failed(exc)
            except Exception:
                log.exception("snapshot task step failed")

    async def _scrape_once(self) -> LoadReport:
        load = await self.scraper.scrape()
        self.stats.load_scrapes += 1
        self.last_load = load
        if self.translator is not None:
            if load.num_gpu_blocks:
                self.translator.capacity_blocks[MEDIUM_GPU] = load.num_gpu_blocks
            if load.block_size and not self.translator.block_size:
                self.translator.block_size = load.block_size
        return load

    async def _metrics_reset_locked(self, prev: LoadReport, load: LoadReport) -> None:
        """The engine's counters went backwards: it restarted (empty cache). The KV-event stream
        only shows that with the new engine's first batch (seq back to 0), which may come much
        later: until then gateways would keep trusting the old engine's blocks. Drop them now,
        unless the stream saw a restart since the previous scrape began (then the new
        engine's blocks may already be in the translator, and the sequencer's resync handled it)."""
        if self.stream.seq.stats.restarts != self._restarts_at_scrape:
            return
        reason = (f"engine restarted (/metrics prefix_cache_queries_total {prev.prefix_cache_queries_total:.0f} "
                  f"-> {load.prefix_cache_queries_total:.0f})")
        log.warning("resync %s: %s", self.cfg.replica_id, reason)
        self.stats.metrics_restarts += 1
        self.stats.engine_resyncs += 1
        self.stats.last_resync_reason = reason
        self.translator.reset()
        await self._publish([FeedEvent(self.cfg.replica_id, 0, "cleared")])
        await self._snapshot_locked()

    async def _load_task(self) -> None:
        rid = self.cfg.replica_id
        while True:
            await asyncio.sleep(self.cfg.load_interval_s)
            if self.scraper is None:  # no engine URL: a heartbeat keeps the replica live in the index
                async with self._lock:
                    await self._publish([FeedEvent(rid, 0, "load")])
                try:
                    await self.feed.set_live(rid, None, self.cfg.live_ttl_s)
                except FeedUnavailable:
                    pass
                continue
            prev = self.last_load
            # The sequencer's restart count as of before this scrape's read: a restart the stream
            # sees while the read is under way may postdate what the read returns (the old
            # engine's counters), so it must not count as seen "as of this scrape".
            restarts_before = self.stream.seq.stats.restarts
            try:
                load = await self._scrape_once()
            except Exception as exc:
                self.stats.load_errors += 1
                self._scrape_log.failed(_describe(exc))
                continue
            self._scrape_log.ok()
            async with self._lock:
                if prev is not None and load.prefix_cache_queries_total < prev.prefix_cache_queries_total:
                    await self._metrics_reset_locked(prev, load)
                self._restarts_at_scrape = restarts_before
                await self._publish([FeedEvent(rid, 0, "load", load=load)])
            try:
                await self.feed.set_live(rid, load, self.cfg.live_ttl_s)
            except FeedUnavailable:
                pass

    # ---------------------------------------------------------------- admin
    def metrics_text(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        agent = self

        class _Collector:
            def collect(self):
                s = agent.stats
                seq = agent.stream.seq.stats
                tr = agent.translator.stats if agent.translator else None
                lbl = ["replica"]
                v = [agent.cfg.replica_id]

                def c(name, doc, val):
                    m = CounterMetricFamily(name, doc, labels=lbl)
                    m.add_metric(v, val)
                    return m

                def g(name, doc, val):
                    m = GaugeMetricFamily(name, doc, labels=lbl)
                    m.add_metric(v, val)
                    return m

                yield c("warmroute_agent_batches", "engine KV-event batches delivered", s.batches)
                yield c("warmroute_agent_decode_errors", "undecodable payloads", s.decode_errors)
                yield c("warmroute_agent_gaps", "seq gaps seen", seq.gaps)
                yield c("warmroute_agent_replays", "replays requested", seq.replays)
                yield c("warmroute_agent_replayed_batches", "batches recovered by replay", seq.replayed)
                yield c("warmroute_agent_resyncs", "resynchronisations (state dropped)", seq.resyncs)
                yield c("warmroute_agent_engine_restarts", "engine restarts seen (seq reset)", seq.restarts)
                yield c("warmroute_agent_metrics_restarts", "engine restarts seen (/metrics counters reset)", s.metrics_restarts)
                yield c("warmroute_agent_feed_errors", "feed publish failures", s.feed_errors)
                yield c("warmroute_agent_feed_republishes", "full republishes after feed loss", s.feed_republishes)
                yield c("warmroute_agent_records_published", "feed records published", s.records_published)
                if tr is not None:
                    yield c("warmroute_agent_blocks_stored", "blocks in BlockStored events", tr.stored_blocks)
                    yield c("warmroute_agent_blocks_removed", "hashes in BlockRemoved events", tr.removed_blocks)
                    yield c("warmroute_agent_unknown_parent_drops", "blocks dropped: parent unknown", tr.unknown_parent_blocks)
                    yield c("warmroute_agent_duplicate_stores", "stores of a held hash", tr.duplicate_stores)
                    m = GaugeMetricFamily("warmroute_agent_keys", "keys held per medium", labels=["replica", "medium"])
                    for medium, keys in agent.translator.keys_by_medium().items():
                        m.add_metric([agent.cfg.replica_id, medium], len(keys))
                    yield m
                yield g("warmroute_agent_lag_seconds", "agent receive time minus engine batch time, last batch", s.last_batch_lag_s)
                yield g("warmroute_agent_feed_offset", "last feed offset published", s.last_offset)
                yield g("warmroute_agent_healthy", "1 if every agent task runs", 1.0 if agent.healthy() else 0.0)

        reg = CollectorRegistry()
        reg.register(_Collector())
        return generate_latest(reg)

    async def _start_admin(self) -> None:
        from aiohttp import web

        async def healthz(_req):
            ok = self.healthy()
            body = {"ok": ok, "replica_id": self.cfg.replica_id, "model": self.model, "epoch": self.epoch,
                    "feed_dirty": self._dirty, "last_offset": self.stats.last_offset,
                    "batches": self.stats.batches, "resyncs": self.stream.seq.stats.resyncs,
                    "last_resync_reason": self.stats.last_resync_reason, "lag_s": self.stats.last_batch_lag_s}
            return web.json_response(body, status=200 if ok else 503)

        async def metrics(_req):
            return web.Response(body=self.metrics_text(), content_type="text/plain", charset="utf-8")

        app = web.Application()
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/metrics", metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.admin_host, self.cfg.admin_port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.admin_url = f"http://{self.cfg.admin_host}:{port}"


async def start_agent(cfg: AgentConfig, feed: Feed) -> RunningAgent:
    """Start an agent in the running loop (embedded mode); `await agent.close()` to stop it."""
    agent = RunningAgent(cfg, feed)
    try:
        await agent._start()
    except BaseException:
        await agent.close()
        raise
    return agent


def _describe(exc: BaseException) -> str:
    """An exception as one short line (aiohttp's connection errors carry no text of their own)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def config_from_args(args) -> AgentConfig:
    g = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    return AgentConfig(
        replica_id=args.replica_id,
        kv_events_endpoint=args.kv_events_endpoint,
        engine_url=g("engine_url"),
        replay_endpoint=g("replay_endpoint"),
        bind=bool(g("bind", False)),
        topic=g("topic", "") or "",
        model=g("model"),
        block_size=int(g("block_size", 0) or 0),
        load_interval_s=float(g("load_interval", 1.0) or 1.0),
        snapshot_interval_s=float(g("snapshot_interval", 5.0) or 5.0),
        admin_host=g("admin_host", "127.0.0.1") or "127.0.0.1",
        admin_port=g("admin_port"),
    )


def _feed_drafts(rid: str, recs) -> list[FeedEvent]:
    """Feed records of translated key changes. vLLM reports evictions one block per event: a run of
    adjacent removals on one medium becomes one record (adjacent only, so the order against the
    stores around them is kept)."""
    drafts: list[FeedEvent] = []
    removed: list = []  # keys of the run of removals being gathered
    medium = None
    for rec in recs:
        if type(rec) is KeysRemoved and (not removed or rec.medium == medium):
            removed.extend(rec.keys)
            medium = rec.medium
            continue
        if removed:
            drafts.append(FeedEvent(rid, 0, "removed", tuple(removed), medium))
            removed = []
        if type(rec) is KeysRemoved:
            removed.extend(rec.keys)
            medium = rec.medium
        elif type(rec) is KeysStored:
            drafts.append(FeedEvent(rid, 0, "stored", rec.keys, rec.medium))
        elif type(rec) is Cleared:
            drafts.append(FeedEvent(rid, 0, "cleared"))
    if removed:
        drafts.append(FeedEvent(rid, 0, "removed", tuple(removed), medium))
    return drafts


def main_from_args(args) -> int:
    """`warmroute agent`: run until SIGINT/SIGTERM (in any state, also while still starting); exit 0
    on a clean stop, 1 when a task died, 2 when it cannot start (e.g. its admin port is taken)."""
    import errno

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(args)

    async def amain() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except NotImplementedError:  # pragma: no cover
                pass
        feed = open_feed(args.feed)
        try:
            # Starting can wait without bound (the engine's /v1/models, a feed that does not
            # answer): race it against the stop signal so TERM/INT end it too.
            starting = asyncio.create_task(start_agent(cfg, feed), name="agent-start")
            stopped = asyncio.create_task(stop.wait(), name="agent-stop")
            await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                log.info("stopping before start-up finished (signal)")
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
                return 0
            stopped.cancel()
            agent = starting.result()
            admin = f"admin {agent.admin_url} (/healthz /metrics)" if agent.admin_url else "no admin port (--admin-port)"
            log.info("agent %s for model %r up; %s", cfg.replica_id, agent.model, admin)
            try:
                while not stop.is_set():
                    try:  # asyncio.timeout, not wait_for: 3.11's wait_for loses a cancel that meets the wake
                        async with asyncio.timeout(1.0):
                            await stop.wait()
                    except TimeoutError:
                        if not agent.healthy():
                            log.error("an agent task died; exiting")
                            return 1
                return 0
            finally:
                await agent.close()
        finally:
            await feed.close()

    import zmq

    try:
        return asyncio.run(amain())
    except zmq.ZMQError as exc:  # binding the SUB socket (--bind)
        print(f"warmroute agent: cannot bind {cfg.kv_events_endpoint} (--kv-events-endpoint): {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        print(f"warmroute agent: cannot listen on {cfg.admin_host}:{cfg.admin_port} (--admin-port): "
              "address already in use", file=sys.stderr)
        return 2
