"""loadtests/vtime_trace.py: the timeline of one virtual-time run must account for the run it
traces (every finished request once, the misses the run counted, each replica's requests) and
name prefixes by how often the run requested them."""
from __future__ import annotations

import collections
import re

import pytest

from loadtests.vtime_trace import format_trace, main, trace


@pytest.fixture(scope="module")
def zipf_trace():
    return trace("busy", "shared_docs_zipf", seed=3, n_requests=400)


def test_trace_accounts_for_the_run(zipf_trace):
    tr = zipf_trace
    s = tr.summary
    assert len(tr.served) == s["completed"] > 0
    assert len(tr.misses()) == s["misses_copy"] + s["misses_evicted"] > 0  # this seed misses (copies of the hot document)
    assert sum(m.copy for m in tr.misses()) == s["misses_copy"]
    finished = collections.Counter(x.replica for x in tr.served)
    if s["unfinished"] == 0:  # every routed request finished: the counts are the router's
        assert [finished[i] for i in range(len(tr.per_replica_requests))] == tr.per_replica_requests
    assert [x.arrival_s for x in tr.served] == sorted(x.arrival_s for x in tr.served)
    assert tr.served[0].arrival_s == 0.0


def test_prefixes_are_ranked_by_requests(zipf_trace):
    tr = zipf_trace
    counts = collections.Counter(x.prefix for x in tr.served)
    assert sorted(tr.rank.values()) == list(range(len(counts)))
    by_rank = sorted(counts, key=tr.rank.get)
    assert [counts[p] for p in by_rank] == sorted(counts.values(), reverse=True)
    assert len(counts) == 24  # the case's documents, each its own prefix (not the shared chat framing)


def test_format_lists_windows_replicas_and_misses(zipf_trace):
    tr = zipf_trace
    text = format_trace(tr, window_s=5.0)
    windows = [ln for ln in text.splitlines() if re.match(r"^\s*\d+s \| r0 ", ln)]
    assert len(windows) == len({int(x.arrival_s // 5.0) for x in tr.served}) > 1
    for ri in range(len(tr.per_replica_requests)):
        assert f"r{ri}: " in text
    missing = text.split("long misses")[1]
    assert missing.count(" copy") + missing.count(" evicted") == len(tr.misses())


def test_cli(capsys):
    assert main(["--case", "shared_docs", "--seed", "1", "--requests", "120", "--window", "20"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("TTFT p50 ") and "per replica" in out
    with pytest.raises(SystemExit):
        main(["--case", "no_such_case"])
    with pytest.raises(SystemExit):
        main(["--window", "0"])


def test_the_copy_in_background_probe_traces_the_same_run_as_the_report():
    """`--copy-in-background CHUNK` runs what `vtime_report --copy-in-background --pace-chunk CHUNK`
    runs: the static plan's second holder is warmed (a warm, no copy miss) instead of copied."""
    from loadtests.vtime_regimes import run_regime
    from loadtests.vtime_pacing import Pacing

    tr = trace("busy", "shared_docs_zipf", seed=2, policy="static_plan", warm_chunk=512)
    plain = trace("busy", "shared_docs_zipf", seed=2, policy="static_plan")
    row = run_regime("busy", [2], ["shared_docs_zipf"], ["static_plan"], pacing=Pacing(None, 512),
                     plan_params={"copy_in_background": True})[0]
    assert tr.summary["warms"] >= 1 and plain.summary["warms"] == 0
    assert plain.summary["misses_copy"] >= 1 and tr.summary["misses_copy"] == 0
    assert tr.summary["ttft_p99_s"] == row["ttft_p99_s"] and tr.summary["misses_copy"] == row["misses_copy"]
    with pytest.raises(SystemExit):
        main(["--copy-in-background", "-1"])


def test_keep_alive_rules_trace_the_same_run_as_the_report():
    """`--keep-alive 1 --keep-alive-priority --keep-alive-max-waiting 8` runs what the report runs
    with the same flags: the first line's figures are the report row's."""
    from loadtests.vtime_keepalive import KeepAlive
    from loadtests.vtime_regimes import run_regime

    ka = KeepAlive(idle_s=1.0, max_waiting=8)
    tr = trace("busy", "shared_docs_zipf", seed=2, n_requests=400, keep_alive=ka, refresh_first=True)
    (row,) = run_regime("busy", [2], ["shared_docs_zipf"], ["cache_plan"], keep_alive=ka, refresh_first=True,
                        n_requests=400)
    assert tr.summary["ttft_p99_s"] == row["ttft_p99_s"] and tr.summary["refreshes"] == row["refreshes"] > 0
    back = trace("busy", "shared_docs_zipf", seed=2, n_requests=400, keep_alive=ka)  # refreshes behind the queue
    assert back.summary != tr.summary
    with pytest.raises(SystemExit):  # priority only with keep-alive
        main(["--keep-alive-priority"])
