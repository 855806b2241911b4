"""LoRA adapters on real vLLM: one replica serving the tiny model and two LoRA adapters of it
(`--enable-lora --lora-modules`), its agent and a gateway configured with the adapters' names
(`model.lora_adapters`), on a Redis of their own. A request for an adapter goes upstream under the
adapter's name; its prediction equals the engine's `cached_tokens`; the same prompt for the base
model or the other adapter is predicted and found cold (the engine keys adapters' blocks apart, and
so do the gateway and the agent, from the events' `lora_name`); with speculation lapsed the index
holds each adapter's keys from the feed. An adapter loaded into the engine at run time
(`/v1/load_lora_adapter`) is served from its first request (the gateway looks a name up before it
refuses it) and predicted like the others; once unloaded, the engine's 404 reaches the client and
the gateway drops it. The engine's LoRA slots (vllm:lora_requests_info) reach
the gateway's index through the agent while an adapter's request runs. Costs one more engine start
(about a minute)."""
from __future__ import annotations

import random
import time

import httpx
import pytest

from .conftest import SERVED_MODEL, WarmSystem
from .launch import ReplicaStartError, start_replicas, stop_replicas
from .make_tiny_model import make_tiny_lora
from .test_vllm_e2e import _server_span

ADAPTERS = ("sql-lora", "chat-lora")
LATE = "late-lora"  # loaded at run time
BLOCK = 32


@pytest.fixture(scope="module")
def lora_system(vllm_python_path, tiny_model_dir, tmp_path_factory):
    try:
        from tests.conftest import running_redis
    except ImportError:
        from conftest import running_redis

    work = tmp_path_factory.mktemp("lora")
    modules = [f"{name}={make_tiny_lora(work / name, tiny_model_dir, seed=i + 1)}" for i, name in enumerate(ADAPTERS)]
    make_tiny_lora(work / LATE, tiny_model_dir, seed=len(ADAPTERS) + 1)
    error, reps = "", []
    try:
        reps = start_replicas(1, tiny_model_dir, served_model_name=SERVED_MODEL, log_dir=work / "logs",
                              extra_args=["--enable-lora", "--max-lora-rank", "8", "--max-loras", "3",
                                          "--lora-modules", *modules],
                              extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    except ReplicaStartError as exc:
        error = str(exc)
    if error:
        pytest.fail(error, pytrace=False)
    try:
        with running_redis() as redis:
            system = WarmSystem(reps, tiny_model_dir, redis.url, work, lora_adapters=ADAPTERS)
            try:
                system.start()
                yield system
            finally:
                system.close()
    finally:
        stop_replicas(reps)


def _ask(system, model: str, prompt: str) -> tuple[int, int, dict]:
    """(engine-reported cached tokens, the gateway's prediction, the upstream usage) of one request."""
    r = httpx.post(system.url + "/v1/completions", headers=system.headers("acme"), timeout=120,
                   json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model  # the engine ran what was asked for (an adapter keeps its name)
    span = _server_span(system, r.headers["x-request-id"])
    usage = r.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], span.attributes["warmroute.predicted_cached_tokens"], usage


def test_adapters_are_routed_and_keyed_apart(lora_system):
    system = lora_system
    rng = random.Random(20261206)
    doc = "Reference: " + " ".join(f"w{rng.randrange(10_000)}" for _ in range(700))
    r = httpx.get(system.url + "/v1/models", headers=system.headers("acme"), timeout=10)
    assert r.status_code == 200
    listed = {m["id"]: m["parent"] for m in r.json()["data"]}
    assert listed == {SERVED_MODEL: None, ADAPTERS[0]: SERVED_MODEL, ADAPTERS[1]: SERVED_MODEL}

    cached, predicted, usage = _ask(system, ADAPTERS[0], doc + "\nQ1: first?")
    assert (cached, predicted) == (0, 0)
    cached, predicted, usage = _ask(system, ADAPTERS[0], doc + "\nQ2: second?")
    assert cached >= BLOCK * 10 and predicted == cached, (cached, predicted, usage)
    # The same document for the base model and for the other adapter: nothing of it is theirs.
    for model in (SERVED_MODEL, ADAPTERS[1]):
        cached, predicted, usage = _ask(system, model, doc + f"\nQ3 ({model})?")
        assert (cached, predicted) == (0, 0), (model, cached, predicted)
    # Each now holds its own copy; again, each predicted exactly.
    for model in (SERVED_MODEL, ADAPTERS[1], ADAPTERS[0]):
        cached, predicted, usage = _ask(system, model, doc + f"\nQ4 ({model})?")
        assert cached >= BLOCK * 10 and predicted == cached, (model, cached, predicted)

    # With speculation lapsed the index holds the three copies from the feed (the agent keys each
    # with the events' lora_name), under the keys the gateway computes for each model.
    time.sleep(system.gateway.cfg.feed.speculative_ttl_s + 0.5)
    gw = system.gateway
    ids = system.call(gw.tokenizer.encode_prompt, doc + "\nQ5?")
    salt = system.salt("acme")
    runs = {}
    for model in (SERVED_MODEL, *ADAPTERS):
        keys = gw.keychain.request_keys(ids, salt=salt, lora=gw.model.lora_of(model))
        runs[model] = system.call(gw.index.match, keys)["r0"].gpu_blocks
    assert all(n >= 10 for n in runs.values()), runs
    assert len({tuple(gw.keychain.request_keys(ids, salt=salt, lora=gw.model.lora_of(m))[:1]) for m in runs}) == 3


def test_an_adapter_loaded_at_run_time_is_served_at_once_and_one_unloaded_is_dropped(lora_system):
    from gateway.adapters import MIN_INTERVAL_S

    system = lora_system
    gw = system.gateway
    rep = system.replicas[0]
    prompt = "Notes: " + " ".join(f"n{i}" for i in range(600))
    body = {"model": LATE, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(system.url + "/v1/completions", headers=system.headers("acme"), json=body, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"  # looked up: not loaded
    path = str(system.workdir / LATE)
    r = httpx.post(rep.url + "/v1/load_lora_adapter", json={"lora_name": LATE, "lora_path": path}, timeout=120)
    assert r.status_code == 200, r.text
    time.sleep(MIN_INTERVAL_S)  # the 404's look may have ended under a second ago (gateway.adapters)
    assert LATE not in gw.model.served  # no discovery round since (every 30 s): the request looks it up
    cached, predicted, _ = _ask(system, LATE, prompt + "\nQ1?")
    assert (cached, predicted) == (0, 0)
    assert gw.model.replicas_for(LATE) == {"r0"}
    cached, predicted, _ = _ask(system, LATE, prompt + "\nQ2?")
    assert cached >= BLOCK * 10 and predicted == cached, (cached, predicted)
    # Unloaded: the engine's own 404 reaches the client, and the gateway drops the adapter there.
    r = httpx.post(rep.url + "/v1/unload_lora_adapter", json={"lora_name": LATE}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(system.url + "/v1/completions", headers=system.headers("acme"), json=body, timeout=60)
    assert r.status_code == 404, r.text
    assert LATE not in gw.model.served and gw.model.replicas_for(LATE) == set()


def test_lora_slots_reach_the_gateway(lora_system):
    """The engine's LoRA slots (vllm:lora_requests_info) as the policy weighs them: while a request
    for an adapter runs, the engine's /metrics names it among the running adapters with its
    `--max-loras`, the agent's load record carries that to the gateway's index, and once the
    request has ended (the client leaves once both were seen: a stream long enough for a slow
    /metrics to be polled on a fast engine) the next records say no adapter runs."""
    import threading

    from replica_agent.scraper import parse_load

    system = lora_system
    gw = system.gateway
    rep = system.replicas[0]
    body = {"model": ADAPTERS[1], "prompt": "Count: " + " ".join(str(i) for i in range(50)), "max_tokens": 3000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    done, seen = threading.Event(), threading.Event()
    statuses: list[int] = []  # an assert in the thread would not fail the test: checked after the join

    def stream() -> None:
        try:
            with httpx.stream("POST", system.url + "/v1/completions", headers=system.headers("acme"), json=body,
                              timeout=180) as r:
                statuses.append(r.status_code)
                for _ in r.iter_bytes():
                    if seen.is_set():
                        break  # closing the stream aborts the request on the engine
        finally:
            done.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    engine = index = last = None
    polls, started = 0, time.monotonic()
    deadline = started + 150  # within the stream's own timeout: a slow machine ends the stream, not the poll
    while time.monotonic() < deadline and not done.is_set() and (engine is None or index is None):
        if engine is None:
            last = parse_load(httpx.get(rep.url + "/metrics", timeout=10).text)
            polls += 1
            if ADAPTERS[1] in last.lora_running:
                engine = last
        if index is None:
            lr = system.call(gw.index.last_load, "r0")
            if lr is not None and ADAPTERS[1] in lr.lora_running:
                index = lr
        time.sleep(0.05)
    waited, ended_first = time.monotonic() - started, done.is_set()
    seen.set()
    t.join(timeout=180)
    assert statuses == [200], statuses
    assert engine is not None, (f"the engine's /metrics never named the running adapter in {polls} polls over "
                                f"{waited:.1f} s (the stream had ended: {ended_first}); the last said {last}")
    assert index is not None, "the agent's load records never brought the running adapter to the gateway"
    assert (engine.max_lora, index.max_lora) == (3, 3) and engine.lora_running == (ADAPTERS[1],)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lr = system.call(gw.index.last_load, "r0")
        if lr.lora_running == () and lr.max_lora == 3:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"the index still shows running adapters after the request ended: {lr}")
