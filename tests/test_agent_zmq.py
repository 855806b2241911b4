"""The agent against real ZMQ sockets: a tiny in-test engine (PUB + replay ROUTER, raw pyzmq)
replays the captured vLLM frames; the agent publishes to a feed; IndexSync keeps a KVIndex."""
from __future__ import annotations

import asyncio
import base64

import pytest
import zmq
import zmq.asyncio

from gateway.index import KVIndex
from gateway.index_sync import IndexSync
from replica_agent.agent import AgentConfig, start_agent
from replica_agent.decode import decode_payload
from replica_agent.feed import open_feed
from replica_agent.translate import Translator
from tests.conftest import free_port

MODEL, BS = "tiny", 32


class FakeEngine:
    """PUB (binds) + ROUTER replay buffer, speaking vLLM's frames."""

    def __init__(self, frames, retain_from: int = 0, old_replay: bool = False):
        self.old_replay = old_replay  # older engines reply without the topic frame
        self.ctx = zmq.asyncio.Context()
        self.pub_ep = f"tcp://127.0.0.1:{free_port()}"
        self.replay_ep = f"tcp://127.0.0.1:{free_port()}"
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(self.pub_ep)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.replay_ep)
        self.topic = frames[0][0]
        self.payloads = [f[2] for f in frames]
        self.buffer: dict[int, bytes] = {}  # seq -> payload, what replay can return
        self.retain_from = retain_from
        self.replay_requests: list[int] = []
        self._task = asyncio.create_task(self._serve_replay())

    async def publish(self, seq: int, payload: bytes, *, drop: bool = False):
        self.buffer[seq] = payload
        if not drop:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        await asyncio.sleep(0.003)

    async def _serve_replay(self):
        while True:
            ident, _, start = await self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            topic = [] if self.old_replay else [self.topic]
            for seq in sorted(self.buffer):
                if seq >= max(start_seq, self.retain_from):
                    await self.router.send_multipart([ident, b"", *topic, seq.to_bytes(8, "big"), self.buffer[seq]])
            await self.router.send_multipart([ident, b"", *([] if self.old_replay else [b""]), b"\xff" * 8, b""])

    async def close(self):
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


@pytest.fixture
def frames(vllm_fixture):
    return [[base64.b64decode(x) for x in f] for f in vllm_fixture["live_frames"]]


def expected_keys(payloads, capacity=None):
    tr = Translator(MODEL, BS, {"GPU": capacity} if capacity else None)
    for p in payloads:
        tr.apply_all(decode_payload(p).events)
    return set(tr.keys())


async def until(pred, timeout_s=8.0, what="condition"):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s}s")
        await asyncio.sleep(0.02)


def index_keys(index: KVIndex, rid: str) -> set:
    bit = 1 << index._slot_of[rid]
    return {k for k, m in index._gpu.items() if m & bit}


async def run_case(frames, feed_url, *, publish_plan, retain_from=0, old_replay=False, generated_in_order=False):
    """publish_plan: list of (seq, frame index, drop) in send order. `generated_in_order`: only the
    delivery is reordered; the engine made its batches in seq order, so its replay buffer holds
    every seq up to the highest one sent (without it a replay asked for a batch that is merely
    late found it missing whenever the agent asked before the late send: a resync, timing-bound)."""
    engine = FakeEngine(frames, retain_from=retain_from, old_replay=old_replay)
    feed = open_feed(feed_url)
    cfg = AgentConfig(replica_id="r1", kv_events_endpoint=engine.pub_ep, replay_endpoint=engine.replay_ep,
                      model=MODEL, block_size=BS, snapshot_interval_s=0.2, replay_timeout_s=2.0, admin_port=0)
    agent = await start_agent(cfg, feed)
    index = KVIndex()
    sync = IndexSync(open_feed(feed_url), index, block_s=0.05, discover_every_s=0.1)
    sync_task = asyncio.create_task(sync.run())
    await asyncio.sleep(0.3)  # let the SUB connect (a slow joiner would be repaired by replay anyway)
    for seq, i, drop in publish_plan:
        if generated_in_order:
            engine.buffer.update({s: frames[j][2] for s, j, _ in publish_plan if s <= seq})
        await engine.publish(seq, frames[i][2], drop=drop)
    return engine, agent, index, sync, sync_task


async def stop(engine, agent, sync_task):
    sync_task.cancel()
    await asyncio.gather(sync_task, return_exceptions=True)
    await agent.close()
    await engine.close()


async def test_fixture_frames_end_to_end_memory_feed(frames):
    n = 30  # up to (not including) the reset, so the end state is the interesting one
    payloads = [f[2] for f in frames[:n]]
    want = expected_keys(payloads)
    engine, agent, index, sync, task = await run_case(frames, "memory://zmq-e2e", publish_plan=[(i, i, False) for i in range(n)])
    try:
        await until(lambda: agent.stats.batches >= n, what="agent batches")
        assert set(agent.translator.keys()) == want
        await until(lambda: "r1" in index.replicas() and index_keys(index, "r1") == want, what="index converged")
        assert agent.stream.seq.stats.resyncs == 0
        # admin endpoints
        import aiohttp

        async with aiohttp.ClientSession() as s:
            async with s.get(agent.admin_url + "/healthz") as r:
                assert r.status == 200 and (await r.json())["ok"]
            async with s.get(agent.admin_url + "/metrics") as r:
                text = await r.text()
        assert "warmroute_agent_batches_total" in text and "warmroute_agent_resyncs_total" in text
    finally:
        await stop(engine, agent, task)


@pytest.mark.parametrize("old_replay", [False, True], ids=["replay-with-topic", "replay-without-topic"])
async def test_dropped_seqs_are_replayed(frames, old_replay):
    n = 30
    plan = [(i, i, i in (3, 4, 12)) for i in range(n)]
    want = expected_keys([f[2] for f in frames[:n]])
    engine, agent, index, sync, task = await run_case(frames, f"memory://zmq-drop-{old_replay}", publish_plan=plan,
                                                      old_replay=old_replay)
    try:
        await until(lambda: agent.stats.batches >= n, what="agent batches")
        st = agent.stream.seq.stats
        assert st.replays >= 2 and st.replayed >= 3 and st.resyncs == 0
        assert 3 in engine.replay_requests and 12 in engine.replay_requests
        assert set(agent.translator.keys()) == want
        await until(lambda: index_keys(index, "r1") == want, what="index converged")
    finally:
        await stop(engine, agent, task)


async def test_unrecoverable_gap_resyncs(frames):
    n = 30
    plan = [(i, i, 3 <= i < 10) for i in range(n)]
    # the engine retains only seq >= 10: the replay starts above what was asked -> resync
    want = expected_keys([f[2] for f in frames[10:n]])
    engine, agent, index, sync, task = await run_case(frames, "memory://zmq-gap", publish_plan=plan, retain_from=10)
    try:
        await until(lambda: agent.stream.seq.stats.resyncs >= 1, what="resync")
        await until(lambda: set(agent.translator.keys()) == want, what="agent relearned")
        assert agent.translator.stats.unknown_parent_blocks > 0  # decode blocks of unseen prompts: dropped
        await until(lambda: index_keys(index, "r1") == want, what="index relearned (old entries dropped)")
        assert "replay starts at 10" in agent.stats.last_resync_reason
    finally:
        await stop(engine, agent, task)


async def test_engine_restart_resyncs(frames):
    plan = [(i, i, False) for i in range(14)] + [(i, i, False) for i in range(6)]  # seq resets to 0
    want = expected_keys([f[2] for f in frames[:6]])
    engine, agent, index, sync, task = await run_case(frames, "memory://zmq-restart", publish_plan=[])
    try:
        for seq, i, drop in plan[:14]:
            await engine.publish(seq, frames[i][2])
        await until(lambda: agent.stats.batches >= 14, what="first life")
        engine.buffer.clear()  # a new engine process has a new replay buffer
        for seq, i, drop in plan[14:]:
            await engine.publish(seq, frames[i][2])
        await until(lambda: agent.stream.seq.stats.restarts == 1, what="restart seen")
        await until(lambda: set(agent.translator.keys()) == want, what="agent relearned")
        await until(lambda: index_keys(index, "r1") == want, what="index relearned")
    finally:
        await stop(engine, agent, task)


@pytest.mark.redis
async def test_redis_restart_survived(frames, redis_server):
    url = redis_server.url
    want_a = expected_keys([f[2] for f in frames[:10]])
    want_b = expected_keys([f[2] for f in frames[:20]])
    engine, agent, index, sync, task = await run_case(frames, url, publish_plan=[(i, i, False) for i in range(10)])
    try:
        await until(lambda: "r1" in index.replicas() and index_keys(index, "r1") == want_a, what="index before restart")
        redis_server.stop()
        for i in range(10, 20):  # the engine goes on while Redis is down; the agent keeps consuming
            await engine.publish(i, frames[i][2])
        await until(lambda: agent.stats.batches >= 20, what="agent consumed during outage")
        assert agent.stats.feed_errors >= 1
        await asyncio.sleep(0.3)
        redis_server.start()
        await until(lambda: agent.stats.feed_republishes >= 1, 10, what="agent republished")
        await until(lambda: index_keys(index, "r1") == want_b, 10, what="running consumer converged")
        # a consumer that starts now rebuilds from the republished snapshot
        late = KVIndex()
        late_sync = IndexSync(open_feed(url), late, block_s=0.05)
        for _ in range(3):
            await late_sync.step()
        assert index_keys(late, "r1") == want_b
    finally:
        await stop(engine, agent, task)
