"""The soak's short form (loadtests/soak.py; the documented run is 10 minutes after a 5-minute
warm-up): the whole system (Redis, 2 simulated replicas, their agents, one gateway process) at a
steady 30 requests/s of unique prompts for 15 s of warm-up and 40 s measured. What must hold: no
request error, the gateway's resident memory within 5% of its size at the end of warm-up, and the
index never above its budget although the unique prompts keep filling it (evictions seen)."""
from __future__ import annotations

import pytest

from loadtests.soak import SoakConfig, run_soak

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(240)]


def test_soak_short_form(tmp_path):
    cfg = SoakConfig(duration_s=40.0, warmup_s=15.0, rate_rps=30.0, workdir=str(tmp_path))
    res = run_soak(cfg)
    mib = 2**20
    print(f"\nsoak short form: {res.requests} requests, {res.errors} errors, {res.shed} shed; RSS "
          f"{res.rss_warm_bytes / mib:.1f} -> max {res.rss_max_bytes / mib:.1f} MiB ({100 * res.rss_growth:+.2f}%); "
          f"index max {res.index_max_seen}/{res.index_budget}, {res.index_evictions} evictions")
    assert res.ok, res.failures
    assert res.requests >= 0.8 * cfg.rate_rps * (cfg.warmup_s + cfg.duration_s)
    assert res.shed == 0
