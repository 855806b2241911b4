"""loadtests.flow_timelines (pure): a request's TTFT split into the gateway, the engine's queue and
its prefill, from the client's and the engines' records on one clock."""
from __future__ import annotations

from loadtests.flow_timelines import timelines


def _trace() -> dict:
    client = [
        {"id": "quiet-0", "tag": "quiet", "sent_at": 100.0, "ttft_s": 0.080, "status": 200, "replica": "r0", "cached": 0, "prompt": 400},
        {"id": "noisy-0", "tag": "noisy", "sent_at": 110.0, "ttft_s": 0.100, "status": 200, "replica": "r0", "cached": 0, "prompt": 400},
        {"id": "quiet-1", "tag": "quiet", "sent_at": 110.1, "ttft_s": 0.400, "status": 200, "replica": "r0", "cached": 368, "prompt": 430},
        {"id": "quiet-2", "tag": "quiet", "sent_at": 111.0, "ttft_s": None, "status": 429, "replica": "", "cached": 0, "prompt": 0},
    ]
    requests = [
        {"id": "quiet-0", "t_arrival": 100.002, "t_sched": 100.01, "t_first": 100.07, "t_done": 100.5, "cached": 0, "prompt": 400,
         "running_at_arrival": 0, "waiting_at_arrival": 0},
        {"id": "noisy-0", "t_arrival": 110.001, "t_sched": 110.01, "t_first": 110.09, "t_done": 111.0, "cached": 0, "prompt": 400,
         "running_at_arrival": 1, "waiting_at_arrival": 0},
        {"id": "quiet-1", "t_arrival": 110.103, "t_sched": 110.4, "t_first": 110.49, "t_done": 111.2, "cached": 368, "prompt": 430,
         "running_at_arrival": 2, "waiting_at_arrival": 0},
    ]
    steps = [[110.01, 110.09, 400, 0, 2, 0], [110.09, 110.2, 0, 2, 2, 1], [110.4, 110.49, 62, 1, 2, 0], [110.49, 110.5, 0, 2, 2, 0]]
    return {"client": client, "engines": {"r0": {"max_num_seqs": 2, "requests": requests, "steps": steps}}}


def test_a_requests_ttft_splits_into_gateway_engine_queue_and_prefill():
    rows = timelines(_trace(), "quiet", after_s=5.0)
    assert [r["id"] for r in rows] == ["quiet-1"]  # quiet-0 is in the warm-up, quiet-2 was refused
    r = rows[0]
    assert (r["gateway_ms"], r["engine_queue_ms"], r["prefill_ms"]) == (3.0, 297.0, 90.0)
    assert r["at_s"] == 10.1 and r["replica"] == "r0" and r["cached"] == 368
    assert r["own_open_at_arrival"] == 0  # quiet-0 finished long before; noisy-0 is not its own
    assert (r["steps_to_first_token"], r["step_ms"], r["step_prefill_tokens"]) == (1, [90.0], [62])
    assert r["cause"] == "full engine"  # 2 running of 2 slots when it arrived
    assert timelines(_trace(), "noisy", after_s=0.0)[0]["id"] == "noisy-0"
    assert len(timelines(_trace(), "quiet", after_s=0.0)) == 2


def test_causes_in_order_held_full_engine_shared_step():
    tr = _trace()
    q1 = tr["engines"]["r0"]["requests"][2]
    q1["running_at_arrival"] = 1
    assert timelines(tr, "quiet", 5.0)[0]["cause"] == "none"  # its step's 62 tokens are its own
    tr["engines"]["r0"]["steps"][2][2] = 126
    assert timelines(tr, "quiet", 5.0)[0]["cause"] == "shared step"
    q1["t_arrival"] = 110.2
    assert timelines(tr, "quiet", 5.0)[0]["cause"] == "held"  # 100 ms before an engine
