"""The load scraper's parser (pure) on vLLM-style and simulator /metrics text."""
from __future__ import annotations

import pytest

from replica_agent.scraper import parse_load

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.75
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 640.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",engine="0",num_gpu_blocks="48",prefix_caching_hash_algo="sha256"} 1.0
"""


def test_parse_vllm_metrics():
    lr = parse_load(VLLM_TEXT, ts=5.0)
    assert (lr.running_reqs, lr.waiting_reqs) == (4, 7)
    assert lr.kv_usage == pytest.approx(0.5)
    assert (lr.prefix_cache_queries_total, lr.prefix_cache_hits_total) == (1000.0, 640.0)
    assert (lr.block_size, lr.num_gpu_blocks, lr.ts) == (32, 48, 5.0)


LORA_TEXT = VLLM_TEXT + """\
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7650000001e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql-lora,chat-lora",waiting_lora_adapters="dyn-lora"} 1.7650000030e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql-lora",waiting_lora_adapters=""} 1.7650000020e+09
"""


def test_lora_slots_are_the_newest_series():
    """Every label set the engine ever had stays in the exposition; the newest one is the state."""
    lr = parse_load(LORA_TEXT, ts=5.0)
    assert (lr.max_lora, lr.lora_running, lr.lora_waiting) == (2, ("sql-lora", "chat-lora"), ("dyn-lora",))
    assert (lr.running_reqs, lr.num_gpu_blocks) == (4, 48)  # the rest as before
    idle = LORA_TEXT.replace("1.7650000001e+09", "1.7650000040e+09")  # the empty set is the newest now
    assert (parse_load(idle).lora_running, parse_load(idle).lora_waiting) == ((), ())
    assert parse_load(idle).max_lora == 2
    assert parse_load(VLLM_TEXT).max_lora == 0  # LoRA off: no series
    bad = LORA_TEXT.replace('max_lora="2"', 'max_lora="two"')
    assert (parse_load(bad).max_lora, parse_load(bad).lora_running) == (0, ())  # no slot count: nothing usable


def test_absent_metrics_read_as_zero():
    lr = parse_load("# nothing here\n", ts=1.0)
    assert (lr.running_reqs, lr.waiting_reqs, lr.kv_usage, lr.block_size, lr.num_gpu_blocks) == (0, 0, 0.0, 0, 0)


def test_garbage_raises():
    with pytest.raises(ValueError):
        parse_load("vllm:num_requests_running{engine= 3 3 3\n")


async def test_parse_simulator_metrics(tokenizer_dir):
    import aiohttp

    from loadtests.sim.server import SimConfig, start_sim_server

    sim = await start_sim_server(SimConfig(model="m", tokenizer=str(tokenizer_dir), block_size=16, num_blocks=100, max_model_len=1024))
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(sim.url + "/metrics") as r:
                text = await r.text()
        lr = parse_load(text)
        assert lr.block_size == 16 and lr.num_gpu_blocks == 100 and lr.running_reqs == 0
    finally:
        await sim.close()
