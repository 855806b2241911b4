"""Calibration converges on synthetic data with outliers, starts from priors, stays clamped."""
from __future__ import annotations

import random

import hypothesis.strategies as st
from hypothesis import given, settings

from policies.calibration import Calibrator


@settings(max_examples=40, deadline=None)
@given(
    true_p=st.floats(1e-5, 4e-4),
    true_step=st.floats(0.005, 0.08),
    outlier_share=st.floats(0.0, 0.3),
    seed=st.integers(0, 2**32),
)
def test_converges_with_outliers(true_p, true_step, outlier_share, seed):
    rng = random.Random(seed)
    cal = Calibrator(prior_prefill_s_per_token=5e-5, prior_decode_step_s=0.02)
    for _ in range(300):
        unc = rng.randint(300, 8000)
        queued = rng.randint(0, 20000)
        ttft = true_p * (unc + queued) * rng.uniform(0.95, 1.05)
        itl = true_step * rng.uniform(0.95, 1.05)
        if rng.random() < outlier_share:
            ttft *= rng.choice([0.05, 10.0, 50.0])
            itl *= rng.choice([0.01, 20.0])
        cal.observe_ttft("r0", ttft, unc, queued, running_reqs=0)
        cal.observe_token_interval("r0", itl)
    assert abs(cal.prefill_s_per_token("r0") / true_p - 1) < 0.15
    assert abs(cal.decode_step_s("r0") / true_step - 1) < 0.15


def test_priors_until_enough_samples_and_clamps_and_determinism():
    cal = Calibrator(prior_prefill_s_per_token=5e-5, prior_decode_step_s=0.02, min_samples=8)
    assert cal.prefill_s_per_token("new") == 5e-5 and cal.decode_step_s("new") == 0.02
    for _ in range(7):
        cal.observe_ttft("a", 1.0, 1000)
    assert cal.prefill_s_per_token("a") == 5e-5
    for _ in range(30):
        cal.observe_ttft("a", 1000.0, 1000)  # absurd: clamped at the ceiling (prior x 20)
    assert cal.prefill_s_per_token("a") == 5e-5 * 20
    cal.observe_ttft("a", 0.0, 1000)  # non-positive: ignored
    cal.observe_ttft("b", 5.0, 10)  # too few tokens: ignored
    assert "b" not in cal.snapshot()
    snap = cal.snapshot()["a"]
    assert snap["prefill_samples"] == 37 and snap["prefill_s_per_token"] == 1e-3
    cal.forget("a")
    assert cal.prefill_s_per_token("a") == 5e-5


def test_hits_behind_a_queue_do_not_inflate_the_prefill_rate():
    """Cache hits (few uncached tokens) whose TTFT is mostly unmodelled waiting behind a queue
    must not be attributed to prefill; the misses (own tokens >= min_sample_tokens) calibrate."""
    rng = random.Random(3)
    true_p = 5e-5
    cal = Calibrator(prior_prefill_s_per_token=5e-5, prior_decode_step_s=0.02)
    for _ in range(400):
        if rng.random() < 0.8:  # a hit: 60 uncached tokens, waits 0.1-0.5 s that the backlog misses
            cal.observe_ttft("r0", 0.004 + rng.uniform(0.1, 0.5), 60, queued_tokens=300, running_reqs=0)
        else:  # a miss behind a correctly estimated queue
            unc, q = rng.randint(1000, 4000), rng.randint(0, 6000)
            cal.observe_ttft("r0", true_p * (unc + q) * rng.uniform(0.97, 1.03), unc, queued_tokens=q, running_reqs=0)
    assert abs(cal.prefill_s_per_token("r0") / true_p - 1) < 0.1
    assert cal.snapshot()["r0"]["prefill_samples"] < 150  # only the misses counted
