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
