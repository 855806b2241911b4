"""Timing probe: can tenant B tell, from its own time to first token, whether tenant A has warmed a
prefix? It must not: A's blocks are salted with A's salt, so B's request for an A-warmed prefix is
as cold as one for a prefix nobody sent.

The test (one simulated replica whose prefill dominates its TTFT: 0.3 ms per uncached token, about
400-token prompts): for each of N = 20 fresh prefixes P_i and Q_i of equal length, A sends P_i
(cold for A) and then P_i again with another question (warm for A); B then sends P_i and Q_i with
its own question, in alternating order (so drift on the shared machine hits both groups alike).
  - Across tenants: B's TTFTs for A-warmed prefixes vs never-sent prefixes, two-sided
    Mann-Whitney U; indistinguishable means p >= 0.001.
  - Within a tenant (the difference that exists): A's warm vs cold TTFTs, same test, p < 1e-6.
  - Power: the test's power to detect the within-tenant difference at n = 20 per group and
    alpha = 0.001, estimated by drawing 20 + 20 from A's measured warm and cold TTFTs 2,000 times:
    at least 0.99 (it is 1.000 in practice: the distributions do not overlap).
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import mannwhitneyu

import aiohttp

from gateway.config import config_from_dict
from gateway.server import start_gateway
from loadtests.sim.scheduler import TimeModel
from loadtests.sim.server import SimConfig, start_sim_server
from tests.fault_harness import stream_chat

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

MODEL = "warmroute-sim"
N = 20
ALPHA = 0.001


def _prefix(tag: str) -> str:
    return " ".join(f"{tag} line {j}: a private document only its owner should be able to warm." for j in range(20))


async def test_tenant_cannot_time_another_tenants_warm_prefixes(tok, tmp_path):
    (tmp_path / "keys.yaml").write_text("tenant-a: [key-a]\ntenant-b: [key-b]\n")
    (tmp_path / "salt.secret").write_text("timing-probe-secret")
    sim = await start_sim_server(SimConfig(model=MODEL, time=TimeModel(step_overhead_s=0.002, prefill_s_per_token=0.0003,
                                                                       decode_s_per_seq=0.0001)))
    cfg = config_from_dict({"server": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
                            "membership": {"replicas": [f"r={sim.url}"]},
                            "auth": {"enabled": True, "api_keys_file": str(tmp_path / "keys.yaml")},
                            "salt": {"secret_file": str(tmp_path / "salt.secret")},
                            "model": {"name": MODEL, "max_model_len": 8192}, "feed": {"load_only": True}}, env={})
    g = await start_gateway(cfg, tokenizer=tok)
    a_cold, a_warm, b_after_a, b_never = [], [], [], []
    try:
        async with aiohttp.ClientSession() as s:
            async def ttft(key, text):
                x = await stream_chat(s, g.url, text, max_tokens=1, headers={"Authorization": f"Bearer {key}"})
                assert x.whole, (x.status, x.body[-200:])
                return x.ttfb_s

            await ttft("key-a", "warm-up the connection pool")
            await ttft("key-b", "warm-up the connection pool")
            for i in range(N):
                p, q = _prefix(f"P{i}"), _prefix(f"Q{i}")
                a_cold.append(await ttft("key-a", p + " A asks one thing?"))
                a_warm.append(await ttft("key-a", p + " A asks another?"))
                if i % 2:
                    b_after_a.append(await ttft("key-b", p + " B asks?"))
                    b_never.append(await ttft("key-b", q + " B asks?"))
                else:
                    b_never.append(await ttft("key-b", q + " B asks?"))
                    b_after_a.append(await ttft("key-b", p + " B asks?"))
    finally:
        await g.close()
        await sim.close()

    cross = mannwhitneyu(b_after_a, b_never, alternative="two-sided")
    within = mannwhitneyu(a_warm, a_cold, alternative="two-sided")
    rng = np.random.default_rng(0)
    warm, cold = np.asarray(a_warm), np.asarray(a_cold)
    rejections = sum(mannwhitneyu(rng.choice(warm, N), rng.choice(cold, N), alternative="two-sided").pvalue < ALPHA
                     for _ in range(2000))
    power = rejections / 2000
    ms = lambda xs: f"{1000 * float(np.median(xs)):.1f}"  # noqa: E731
    print(f"\nTTFT medians ms: A cold {ms(a_cold)}, A warm {ms(a_warm)}; B on A-warmed {ms(b_after_a)}, "
          f"B on never-sent {ms(b_never)}; cross-tenant p = {cross.pvalue:.3f}, within-tenant p = {within.pvalue:.1e}, "
          f"power at n={N}, alpha={ALPHA}: {power:.3f}")
    assert within.pvalue < 1e-6, "the warm-vs-cold difference exists within a tenant"
    assert power >= 0.99, power
    assert cross.pvalue >= ALPHA, f"B can tell A's warm prefixes apart: p = {cross.pvalue}"
