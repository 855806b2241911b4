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
