"""The LoRA-slot benchmark's short form (loadtests/bench_lora.py; its full run is a documented
command): both variants serve the same stream without errors, the gateway sees each engine's LoRA
slots when they are exported and none when they are not, and the engines count the requests that
waited for a slot."""
from __future__ import annotations

from loadtests.bench_lora import main_async, parse_args, stream


async def test_short_run_serves_both_variants_and_the_gateway_sees_the_slots_only_when_exported():
    args = parse_args(["--requests", "16", "--rate", "4", "--adapters", "6", "--output-tokens", "16"])
    assert [(r.body, r.arrival_s) for r in stream(args)] == [(r.body, r.arrival_s) for r in stream(args)]
    report = await main_async(args)
    (visible,), (hidden,) = report["runs"]["visible"], report["runs"]["hidden"]
    for r in (visible, hidden):
        assert r["requests"] == 16 and r["errors"] == 0, r["error_reasons"]
        assert set(r["lora_waits_per_replica"]) == {"r0", "r1", "r2", "r3"}
    assert set(visible["gateway_saw_max_lora"].values()) == {2}
    assert set(hidden["gateway_saw_max_lora"].values()) <= {0, None}


def test_virtual_time_form_routes_by_the_slots_only_when_exported():
    """`--vtime`: the same comparison in virtual time, where the gateway's routing sees the
    modelled engines' slots in the visible variant only; there, far fewer requests wait for one."""
    from loadtests.bench_lora import vtime_main

    report = vtime_main(parse_args(["--vtime", "0", "--requests", "160"]))
    (visible,), (hidden,) = report["runs"]["visible"], report["runs"]["hidden"]
    assert visible["requests"] == hidden["requests"] == 160 and visible["errors"] == hidden["errors"] == 0
    assert hidden["lora_waits"] >= 20 and visible["lora_waits"] * 4 <= hidden["lora_waits"], (visible, hidden)
    assert report["medians"]["visible"]["lora_waits"] == visible["lora_waits"]


async def test_several_embedded_gateways_share_one_pool_and_see_each_others_adapters():
    """`--gateways` on the wall clock: gateway instances on one feed, the load sent to each in turn;
    while one gateway's requests for an adapter run, the other's view of that replica names the
    adapter (the in-flight exchange; ~5 s streams outlast the quiet exchange period), and every
    request is answered."""
    import asyncio

    from loadtests.harness import EmbeddedSystem, SystemSpec
    from loadtests.runner import BenchRequest, run_load

    spec = SystemSpec(replicas=2, model="lora-bench", num_blocks=512, auth=False, lora_modules=("a-0", "a-1"),
                      max_loras=1, gateways=2, agent_load_interval_s=5.0)  # the engines' reports come late here
    async with EmbeddedSystem(spec) as system:
        assert len(set(system.urls)) == 2
        first, second = (g.gateway for g in system.gateways)
        reqs = [BenchRequest(0.05 * i, "/v1/completions", {"model": "a-0", "prompt": f"Request {i}: " + "w " * 40,
                                                              "max_tokens": 400, "ignore_eos": True}) for i in range(4)]
        load = asyncio.create_task(run_load(system.urls[:1], reqs, timeout_s=60))  # all through the first
        seen: set = set()
        for _ in range(300):  # a gateway whose peers have nothing in flight exchanges once a second
            await asyncio.sleep(0.05)
            for ld in second.routing.load.snapshot().values():
                seen.update(ld.others_lora_running + ld.others_lora_wanting)
            if seen or load.done():
                break
        samples, _ = await load
        assert [s.status for s in samples] == [200] * 4
        assert seen == {"a-0"}, seen
        samples, _ = await run_load(system.urls, reqs, timeout_s=60)  # spread over both in turn
        assert [s.status for s in samples] == [200] * 4
        assert sum(ld.active_reqs + ld.inflight_reqs for ld in first.routing.load.snapshot().values()) == 0
