"""End to end: simulated replicas -> agents (real ZMQ) -> Redis feed -> IndexSync -> KVIndex.

After a request lands on replica r, the keys a gateway computes for it (KeyChain with the same
model and block size, tokens from the replica's /tokenize, the salt it sent as cache_salt) are found
on r and on no other replica; two tenants' salted requests produce disjoint keys."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gateway.index import KVIndex, Match
from gateway.index_sync import IndexSync
from hashing.keys import KeyChain
from loadtests.sim.scheduler import TimeModel
from loadtests.sim.server import SimConfig, start_sim_server
from replica_agent.agent import AgentConfig, start_agent
from replica_agent.feed import open_feed
from tests.conftest import free_port

pytestmark = pytest.mark.redis

FAST = TimeModel(step_overhead_s=0.001, prefill_s_per_token=1e-5, decode_s_per_seq=1e-5)
BS = 16
MODEL = "e2e-model"
DOC = " ".join(f"word{i} of the shared document about routers and caches" for i in range(40))


async def until(pred, timeout_s=10.0, what="condition"):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await pred():
        if loop.time() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s}s")
        await asyncio.sleep(0.05)


async def test_sim_agent_redis_index(tokenizer_dir, redis_server):
    sims, agents = {}, {}
    http = aiohttp.ClientSession()
    index = KVIndex()
    sync = IndexSync(open_feed(redis_server.url), index, block_s=0.05, discover_every_s=0.1)
    task = None
    try:
        for rid in ("r1", "r2"):
            pub, rep = free_port(), free_port()
            # 127.0.0.1 endpoints: the engine's PUB connects, so the agent binds (vLLM's rule)
            sims[rid] = await start_sim_server(SimConfig(
                model=MODEL, tokenizer=str(tokenizer_dir), block_size=BS, num_blocks=512, time=FAST, max_model_len=4096,
                kv_events_endpoint=f"tcp://127.0.0.1:{pub}", replay_endpoint=f"tcp://127.0.0.1:{rep}"))
            agents[rid] = await start_agent(AgentConfig(
                replica_id=rid, engine_url=sims[rid].url, kv_events_endpoint=f"tcp://127.0.0.1:{pub}",
                replay_endpoint=f"tcp://127.0.0.1:{rep}", bind=True, load_interval_s=0.2,
                snapshot_interval_s=0.5), open_feed(redis_server.url))
        assert agents["r1"].model == MODEL  # read from the engine's /v1/models
        task = asyncio.create_task(sync.run())
        await asyncio.sleep(0.5)  # the engines' PUB sockets connect to the agents

        async def send(rid, salt):
            body = {"model": MODEL, "prompt": DOC, "max_tokens": 2, "cache_salt": salt}
            async with http.post(sims[rid].url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
            async with http.post(sims[rid].url + "/tokenize", json={"model": MODEL, "prompt": DOC}) as r:
                tokens = (await r.json())["tokens"]
            return KeyChain(MODEL, BS).request_keys(tokens, salt=salt), len(tokens)

        keys_a, n_tokens = await send("r1", "tenant-a")
        n_blocks = n_tokens // BS
        assert n_blocks >= 10 and len(keys_a) == n_blocks

        async def on_r1_only():
            m = index.match(keys_a)
            return m.get("r1") == Match(n_blocks, n_blocks) and "r2" not in m

        await until(on_r1_only, what="tenant-a keys on r1 only")

        keys_b, _ = await send("r2", "tenant-b")
        assert not set(keys_a) & set(keys_b)  # the salt separates tenants

        async def b_on_r2_only():
            mb, ma = index.match(keys_b), index.match(keys_a)
            return mb.get("r2") == Match(n_blocks, n_blocks) and "r1" not in mb and "r2" not in ma

        await until(b_on_r2_only, what="tenant-b keys on r2 only")
        # the unsalted prompt matches nowhere: its keys differ from both tenants'
        async with http.post(sims["r1"].url + "/tokenize", json={"model": MODEL, "prompt": DOC}) as r:
            plain = KeyChain(MODEL, BS).request_keys((await r.json())["tokens"])
        assert index.match(plain) == {}
        # load reports flowed too
        async def has_load():
            lr = index.last_load("r1")
            return lr is not None and lr.block_size == BS and lr.num_gpu_blocks == 512

        await until(has_load, what="load report")
        assert all(a.stream.seq.stats.resyncs == 0 for a in agents.values())
    finally:
        if task:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for a in agents.values():
            await a.close()
            await a.feed.close()
        for s in sims.values():
            await s.close()
        await http.close()
