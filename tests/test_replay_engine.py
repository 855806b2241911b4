"""loadtests/replay_engine.py: a run's samples replayed replica by replica through the engine model."""
from __future__ import annotations

from loadtests.replay_engine import replay, report
from loadtests.vtime_regimes import REGIMES, build_case


def _samples(case, cached_frac: float):
    out = []
    for r in case.workload.requests:
        doc = next(s.seg_id for s in r.segments if s.kind == "document")
        out.append({"router": "x", "tag": r.request_id, "ok": True, "start_s": 100.0 + r.arrival_s, "ttft_s": 0.5,
                    "prompt_tokens": r.prompt_tokens, "cached_tokens": int(cached_frac * r.prompt_tokens),
                    "replica": f"r{int(doc.split('/')[1]) % 4}"})  # 6 documents each: they fit its KV
    return out


def test_replay_prewarms_what_the_run_found_cached_and_times_from_the_first_send():
    c = build_case("busy", "shared_docs", 0, n_requests=120)
    p = REGIMES["busy"].params
    warm = replay(_samples(c, 0.95), c, p)
    assert set(warm) == {"r0", "r1", "r2", "r3"} and sum(len(v) for v in warm.values()) == 120
    assert min(x.arrival_s for v in warm.values() for x in v) == 0.0
    rows = [x for v in warm.values() for x in v]
    assert all(2 * x.engine_uncached < x.prompt_tokens for x in rows)  # every document pre-warmed: hits only
    assert all(0.0 < x.engine_ttft_s < 5.0 and x.measured_ttft_s == 0.5 for x in rows)
    # the run found nothing cached: no warm-up is modelled, so each document's first request misses
    cold = replay(_samples(c, 0.0), c, p)
    long_misses = sum(2 * x.engine_uncached > x.prompt_tokens for v in cold.values() for x in v)
    n_docs = len({s.seg_id for r in c.workload.requests for s in r.segments if s.kind == "document"})
    assert long_misses == n_docs
    text = report(warm)
    assert text.startswith(f"r0: {len(warm['r0'])} requests; TTFT p50 / p99 s: engine alone")
    assert "long misses 0 / 0" in text


def test_samples_of_another_length_are_refused_not_half_replayed(tmp_path, capsys):
    """A run of N requests (compare_peers --regime-requests N) replays with --requests N; without
    it the case's own 1,500 would match only the first part of the run and report that part."""
    import json

    import pytest

    from loadtests.replay_engine import main

    c = build_case("busy", "shared_docs", 0, n_requests=1800)
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in _samples(c, 0.95)))
    args = ["--samples", str(path), "--regime", "busy", "--case", "shared_docs", "--seed", "0"]
    with pytest.raises(SystemExit):
        main(args)
    assert "300 of 1800 samples are not requests" in capsys.readouterr().err
    assert main(args + ["--requests", "1800"]) == 0
    out = capsys.readouterr().out
    assert sum(int(line.split(":")[1].split()[0]) for line in out.splitlines() if line.startswith("r")) == 1800
