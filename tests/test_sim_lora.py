"""LoRA in the simulated replica: the engine batches at most `max_loras` adapters (vLLM's
scheduler skips a waiting request whose adapter has no slot and tries the next), an adapter's
blocks are hashed and reported apart (the agent keys them as the gateway does), and the server
lists the adapters, answers under their names and exports vllm:lora_requests_info, which the
agent's parser reads."""
from __future__ import annotations

import aiohttp

from hashing.keys import KeyChain
from loadtests.sim.config import SimConfig
from loadtests.sim.kv_events import encode_batch
from loadtests.sim.scheduler import RUNNING, WAITING, EngineConfig, SimEngine, SimRequest
from loadtests.sim.server import start_sim_server
from replica_agent.decode import decode_payload
from replica_agent.scraper import parse_load
from replica_agent.translate import KeysStored, Translator


def _engine(max_loras: int) -> SimEngine:
    return SimEngine(EngineConfig(block_size=16, num_blocks=200, max_loras=max_loras))


def test_a_batch_runs_at_most_max_loras_adapters():
    eng = _engine(1)
    a1 = eng.add_request(SimRequest("a1", list(range(40)), max_tokens=3, lora="a"))
    b1 = eng.add_request(SimRequest("b1", list(range(100, 140)), max_tokens=3, lora="b"))
    base = eng.add_request(SimRequest("base", list(range(200, 240)), max_tokens=3))
    a2 = eng.add_request(SimRequest("a2", list(range(300, 340)), max_tokens=3, lora="a"))
    eng.step()
    # b1 has no slot (a holds the only one): skipped, and the requests behind it are admitted
    assert (a1.status, b1.status, base.status, a2.status) == (RUNNING, WAITING, RUNNING, RUNNING)
    assert list(eng.waiting) == [b1] and eng.lora_adapters() == (["a"], ["b"])
    assert b1.lora_waited and eng.num_lora_waits_total == 1
    for _ in range(3):
        eng.step()
    assert a1.num_output_tokens == 3 and a2.num_output_tokens == 3  # a's requests done: the slot is free
    assert b1.status == RUNNING and eng.lora_adapters() == (["b"], [])
    free = _engine(0)  # no limit: all admitted at once
    reqs = [free.add_request(SimRequest(f"r{i}", list(range(i * 50, i * 50 + 40)), lora=lora))
            for i, lora in enumerate(("a", "b", "c"))]
    free.step()
    assert all(r.status == RUNNING for r in reqs)


def test_an_adapters_blocks_are_its_own_and_keyed_as_the_gateway_keys_them():
    eng = _engine(2)
    prompt = list(range(1000, 1050))  # 3 full blocks
    for rid, lora in (("a", "sql"), ("base", None)):
        eng.add_request(SimRequest(rid, prompt, max_tokens=1, lora=lora))
    eng.step()
    events = eng.take_events()
    stored = [e for e in events if hasattr(e, "lora_name")]
    assert sorted(str(e.lora_name) for e in stored) == ["None", "sql"]
    assert len({tuple(e.block_hashes) for e in stored}) == 2  # the same tokens, two sets of blocks
    later = eng.add_request(SimRequest("a2", prompt + [7], max_tokens=1, lora="sql"))
    other = eng.add_request(SimRequest("b", prompt + [7], max_tokens=1, lora="chat"))
    eng.step()
    assert later.num_cached_tokens == 48 and other.num_cached_tokens == 0  # its own adapter's blocks only
    tr = Translator("m", 16)
    keys = {}
    for ev in decode_payload(encode_batch(events)).events:
        for rec in tr.apply(ev):
            if isinstance(rec, KeysStored):
                keys[ev.lora_name] = rec.keys
    chain = KeyChain("m", 16)
    assert keys["sql"] == tuple(chain.request_keys(prompt, lora="sql")[:3])
    assert keys[None] == tuple(chain.request_keys(prompt)[:3])


async def test_the_server_serves_adapters_and_reports_its_slots(tokenizer_dir):
    cfg = SimConfig(model="m", tokenizer=str(tokenizer_dir), block_size=16, num_blocks=400, max_model_len=4096,
                    lora_modules=("sql", "chat"), max_loras=1)
    sim = await start_sim_server(cfg)
    hidden = await start_sim_server(SimConfig(model="m", tokenizer=str(tokenizer_dir), block_size=16, num_blocks=400,
                                              max_model_len=4096, lora_modules=("sql",), lora_metrics=False))
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(sim.url + "/v1/models") as r:
                assert {m["id"]: m["parent"] for m in (await r.json())["data"]} == {"m": None, "sql": "m", "chat": "m"}
            async with s.post(sim.url + "/v1/completions", json={"model": "sql", "prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200 and (await r.json())["model"] == "sql"
            async with s.post(sim.url + "/v1/completions", json={"model": "nope", "prompt": "hi"}) as r:
                assert r.status == 404
            assert parse_load(await (await s.get(sim.url + "/metrics")).text()).max_lora == 1
            # the engine's state in the middle of a step: sql running, chat waiting for the slot
            eng = sim.server.engine
            eng.add_request(SimRequest("x", list(range(40)), max_tokens=50, lora="sql"))
            eng.add_request(SimRequest("y", list(range(100, 140)), max_tokens=50, lora="chat"))
            eng.step()
            lr = parse_load(await (await s.get(sim.url + "/metrics")).text())
            assert (lr.max_lora, lr.lora_running, lr.lora_waiting) == (1, ("sql",), ("chat",))
            eng.abort_all()
            lr = parse_load(await (await s.get(sim.url + "/metrics")).text())
            assert (lr.lora_running, lr.lora_waiting) == ((), ())  # the newest series, not the busiest
            assert parse_load(await (await s.get(hidden.url + "/metrics")).text()).max_lora == 0
    finally:
        await sim.close()
        await hidden.close()
