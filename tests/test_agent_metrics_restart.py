"""The agent notices an engine restart from its /metrics counters going backwards, before the new
engine emits any KV event (seen against real vLLM: without this the gateways kept trusting a
restarted, empty engine's old blocks until its first batch; tests/real_vllm/test_vllm_e2e.py)."""
from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
from aiohttp import web

from replica_agent.agent import AgentConfig, start_agent
from replica_agent.feed import open_feed
from tests.conftest import serve_app

METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} 0.0
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {q}
"""


def _batch(block_hash: int, tokens: list[int]) -> bytes:
    ev = {"type": "BlockStored", "block_hashes": [block_hash], "parent_block_hash": None, "token_ids": tokens,
          "block_size": 32, "lora_id": None, "medium": "GPU", "lora_name": None}
    return msgspec.msgpack.encode([time.time(), [ev], 0])


async def _until(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("order", ["metrics_first", "event_first", "scrape_across_restart"])
async def test_metrics_counter_reset_clears_before_first_event(order):
    """metrics_first: the scrape sees the reset before any event (the agent clears at once);
    event_first: the new engine's first batch comes first (the sequencer's resync handles it);
    scrape_across_restart: a scrape reads the old engine, the batch arrives before that scrape's
    answer is handled, and the next scrape sees the reset (still the sequencer's restart)."""
    event_first = order != "metrics_first"
    state = {"q": 100.0, "agent": None, "new_engine_at_restart": False, "stall": None}

    async def metrics(_req):
        q = state["q"]
        stalled = state["stall"]
        if stalled is not None and not stalled.is_set():
            stalled.set()  # this scrape read the old engine; its answer comes back after the restart
            await _until(lambda: state["agent"].stream.seq.stats.restarts >= 1)
        elif state["new_engine_at_restart"] and state["agent"].stream.seq.stats.restarts >= 1:
            q = 0.0  # a restarted engine's counters start at 0: every scrape served after the restart sees it
        return web.Response(text=METRICS.format(q=q), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner, url = await serve_app(app)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    feed = open_feed(f"memory://restart-{order}")
    agent = await start_agent(AgentConfig(replica_id="r0", kv_events_endpoint=f"tcp://127.0.0.1:{port}", engine_url=url,
                                          model="m", block_size=32, load_interval_s=0.05), feed)
    state["agent"] = agent
    try:
        await asyncio.sleep(0.3)  # subscription propagates
        pub.send_multipart([b"kv", (0).to_bytes(8, "big"), _batch(11, list(range(32)))])
        await _until(lambda: sum(len(k) for k in agent.translator.keys_by_medium().values()) == 1)
        await asyncio.sleep(0.2)  # scrapes see q=100
        if event_first:
            # The new engine's first batch (seq 0 again) arrives before any scrape sees the reset
            # (a scrape may be under way, reading the old engine): the sequencer's resync handles
            # it and the scrapes must not drop the new block.
            state["new_engine_at_restart"] = True
            if order == "scrape_across_restart":
                state["stall"] = asyncio.Event()
                await asyncio.wait_for(state["stall"].wait(), 5.0)
            pub.send_multipart([b"kv", (0).to_bytes(8, "big"), _batch(22, list(range(100, 132)))])
            await _until(lambda: agent.stream.seq.stats.restarts == 1)
            await _until(lambda: agent.last_load.prefix_cache_queries_total == 0.0)  # a scrape saw the reset
            await asyncio.sleep(0.2)
            assert agent.stats.metrics_restarts == 0
            assert sum(len(k) for k in agent.translator.keys_by_medium().values()) == 1
        else:
            state["q"] = 0.0  # restarted engine, no event yet
            await _until(lambda: agent.stats.metrics_restarts == 1)
            assert sum(len(k) for k in agent.translator.keys_by_medium().values()) == 0
            assert "metrics" in agent.stats.last_resync_reason
            await asyncio.sleep(0.2)
            assert agent.stats.metrics_restarts == 1  # once per reset, not per scrape
    finally:
        await agent.close()
        await feed.close()
        pub.close(0)
        ctx.term()
        await runner.cleanup()
