"""The simulator over real HTTP: the official openai SDK, cached tokens and salts, tokenization
parity with the real engine's /tokenize (captured fixture), vLLM's 400s, metrics, faults."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest

from loadtests.sim.scheduler import TimeModel
from loadtests.sim.server import SimConfig, start_sim_server

# wall-clock profile, small enough to keep tests fast but with visible prefill cost (0.2 ms/token)
FAST = TimeModel(step_overhead_s=0.002, prefill_s_per_token=2e-4, decode_s_per_seq=1e-5)


@pytest.fixture
async def sim(tokenizer_dir):
    s = await start_sim_server(SimConfig(model="sim-model", tokenizer=str(tokenizer_dir), num_blocks=2048, time=FAST, max_model_len=8192))
    try:
        yield s
    finally:
        await s.close()


LONG_DOC = " ".join(f"word{i % 97} fact {i}" for i in range(900))


async def _stream_chat(client: openai.AsyncOpenAI, content: str, salt: str | None = None) -> tuple[float, str, object]:
    t0 = time.perf_counter()
    extra = {"cache_salt": salt} if salt else None
    stream = await client.chat.completions.create(
        model="sim-model",
        messages=[{"role": "system", "content": LONG_DOC}, {"role": "user", "content": content}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    ttft = None
    text = ""
    usage = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    assert ttft is not None
    return ttft, text, usage


async def test_openai_sdk_streams_and_reports_cached_tokens(sim) -> None:
    client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)
    try:
        ttft_cold, text, usage = await _stream_chat(client, "first question?")
        assert text == " the quick brown fox jumps over"
        assert usage.completion_tokens == 6 and usage.prompt_tokens > 1000
        assert usage.prompt_tokens_details.cached_tokens == 0
        ttft_warm, _, usage2 = await _stream_chat(client, "another question?")
        cached = usage2.prompt_tokens_details.cached_tokens
        assert cached > 1000 and cached % 16 == 0 and cached < usage2.prompt_tokens
        assert ttft_warm < ttft_cold * 0.7, (ttft_warm, ttft_cold)
        _, _, usage3 = await _stream_chat(client, "another question?", salt="tenant-b")
        assert usage3.prompt_tokens_details.cached_tokens == 0
        # non-streaming completion through the SDK
        comp = await client.completions.create(model="sim-model", prompt="hello world", max_tokens=3)
        assert comp.choices[0].text == " the quick brown" and comp.choices[0].finish_reason == "length"
        models = await client.models.list()
        assert [m.id for m in models.data] == ["sim-model"]
    finally:
        await client.close()


async def test_sse_wire_format(sim) -> None:
    async with aiohttp.ClientSession() as s:
        body = {"model": "sim-model", "prompt": "hi there", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(sim.url + "/v1/completions", json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            raw = (await r.read()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == " the quick brown"


async def test_tokenize_parity_with_real_engine(sim, vllm_fixture) -> None:
    checked = 0
    async with aiohttp.ClientSession() as s:
        for entry in vllm_fixture["requests"]:
            req = entry.get("request")
            if not req:
                continue
            body = {"messages": req["messages"]} if "messages" in req else {"prompt": req["prompt"]}
            async with s.post(sim.url + "/tokenize", json=body) as r:
                got = await r.json()
            assert got["tokens"] == entry["tokenize"]
            assert got["count"] == len(entry["tokenize"]) == entry["usage"]["prompt_tokens"]
            assert got["max_model_len"] == 8192
            checked += 1
            # render routes agree with /tokenize
            route = "/v1/chat/completions/render" if "messages" in req else "/v1/completions/render"
            async with s.post(sim.url + route, json=body) as r:
                assert (await r.json())["token_ids"] == entry["tokenize"]
        async with s.post(sim.url + "/tokenize", json={"prompt": "hello world", "return_token_strs": True}) as r:
            got = await r.json()
        assert got["token_strs"] == ["hello", "Ġworld"]
    assert checked == 10


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", b"{not json", None),
        ("/v1/completions", b"[1, 2]", None),
        ("/v1/completions", {"model": "sim-model"}, "prompt"),
        ("/v1/chat/completions", {"model": "sim-model"}, "messages"),
        ("/v1/chat/completions", {"messages": "hello"}, "messages"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "hi " * 9000}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 8192}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "cache_salt": ""}, "cache_salt"),
        ("/v1/completions", {"prompt": "hi", "cache_salt": "x" * 129}, "cache_salt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "cache_salt": "a@b"}, "cache_salt"),
        ("/v1/completions", {"prompt": "hi", "cache_salt": "a/b"}, "cache_salt"),
        ("/v1/completions", {"prompt": "hi", "cache_salt": "a\\b"}, "cache_salt"),
        ("/v1/completions", {"prompt": "hi", "cache_salt": "a\x00b"}, "cache_salt"),
        ("/v1/completions", {"prompt": "hi", "cache_salt": 5}, "cache_salt"),
        ("/v1/completions", {"prompt": "hi", "priority": 1}, "priority"),  # FCFS, as vLLM's default
        ("/v1/completions", {"prompt": "hi", "priority": "high"}, "priority"),
        ("/tokenize", {"nothing": 1}, "prompt"),
    ],
)
async def test_bad_input_gets_vllm_400(sim, path, body, param) -> None:
    async with aiohttp.ClientSession() as s:
        kw = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with s.post(sim.url + path, headers={"Content-Type": "application/json"}, **kw) as r:
            assert r.status == 400
            err = (await r.json())["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["message"]
    assert err["param"] == param
    # and the server is still fine
    async with aiohttp.ClientSession() as s:
        async with s.get(sim.url + "/health") as r:
            assert r.status == 200


async def test_routes_metrics_and_unknown_paths(sim) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(sim.url + "/server_info") as r:
            assert r.status == 404
        async with s.post(sim.url + "/v1/completions", json={"model": "other", "prompt": "x"}) as r:
            assert r.status == 404 and (await r.json())["error"]["type"] == "NotFoundError"
        async with s.get(sim.url + "/kv_event_sources") as r:
            assert await r.json() == []  # no events configured
        async with s.post(sim.url + "/v1/completions", json={"prompt": LONG_DOC, "max_tokens": 2}) as r:
            assert r.status == 200
        async with s.post(sim.url + "/v1/completions", json={"prompt": LONG_DOC, "max_tokens": 2}) as r:
            hit = (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
        async with s.get(sim.url + "/metrics") as r:
            text = await r.text()
    lines = {ln.split(" ")[0]: float(ln.split(" ")[-1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
    lbl = '{engine="0",model_name="sim-model"}'
    assert lines["vllm:prefix_cache_hits_total" + lbl] == hit > 0
    assert lines["vllm:prefix_cache_queries_total" + lbl] > 2 * hit
    assert lines["vllm:num_requests_running" + lbl] == 0
    assert 0 < lines["vllm:kv_cache_usage_perc" + lbl] or lines["vllm:kv_cache_usage_perc" + lbl] == 0
    assert "vllm:num_preemptions_total" + lbl in lines
    info = [ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{")][0]
    for part in ('block_size="16"', 'num_gpu_blocks="2048"', 'enable_prefix_caching="True"', 'prefix_caching_hash_algo="sha256_cbor"'):
        assert part in info
    assert lines['vllm:time_to_first_token_seconds_count' + lbl] == 2


async def test_client_disconnect_aborts_and_frees_blocks(sim) -> None:
    eng = sim.engine
    async with aiohttp.ClientSession() as s:
        body = {"prompt": LONG_DOC, "max_tokens": 1000, "stream": True}
        async with s.post(sim.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            await r.content.readline()  # first chunk arrived: it is running
            assert eng.num_running == 1 and eng.pool.num_used_blocks > 0
    for _ in range(100):
        if eng.num_running == 0:
            break
        await asyncio.sleep(0.02)
    assert eng.num_running == 0 and eng.pool.num_used_blocks == 0
    assert sim.server.num_aborted_total == 1


async def test_faults_crash_stall_slow_restart(sim) -> None:
    async with aiohttp.ClientSession() as s:
        async def fault(spec):
            async with s.post(sim.url + "/sim/fault", json=spec) as r:
                assert r.status == 200, await r.text()

        async def complete(max_tokens=2):
            t0 = time.perf_counter()
            async with s.post(sim.url + "/v1/completions", json={"prompt": "x y z", "max_tokens": max_tokens}) as r:
                return r.status, time.perf_counter() - t0

        assert (await complete())[0] == 200
        await fault({"kind": "stall", "duration_s": 0.5})
        status, dt = await complete()
        assert status == 200 and dt >= 0.45
        await fault({"kind": "slow", "factor": 20})
        status, dt_slow = await complete(max_tokens=20)
        await fault({"kind": "clear"})
        status, dt_fast = await complete(max_tokens=20)
        assert dt_slow > 5 * dt_fast
        await fault({"kind": "crash"})
        async with s.get(sim.url + "/health") as r:
            assert r.status == 503
        assert (await complete())[0] == 500
        await fault({"kind": "recover"})
        async with s.get(sim.url + "/health") as r:
            assert r.status == 200
        assert (await complete())[0] == 200
        await fault({"kind": "crash", "refuse": True})
        await asyncio.sleep(0.05)
        with pytest.raises(aiohttp.ClientConnectionError):
            await complete()
        await fault_after_refuse(sim)
        assert (await complete())[0] == 200
        async with s.post(sim.url + "/sim/fault", json={"kind": "bogus"}) as r:
            assert r.status == 400


async def fault_after_refuse(sim) -> None:
    # the HTTP port is closed: recover through the in-process handle, as an orchestrator restarting the pod would
    sim.server.apply_fault({"kind": "recover"})
    for _ in range(50):
        try:
            async with aiohttp.ClientSession() as s, s.get(sim.url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.02)
    raise AssertionError("sim did not come back after recover")


async def test_trace_keeps_each_requests_timeline_and_the_steps(tokenizer_dir) -> None:
    """SimConfig.trace: GET /sim/trace lists each request at its first token under the caller's
    X-Request-Id, with its arrival, first scheduling and first token in order, its cached tokens,
    the engine's load at its arrival and when it finished; and the steps; `?clear=1` empties both.
    Without `trace` nothing is kept."""
    s = await start_sim_server(SimConfig(model="sim-model", tokenizer=str(tokenizer_dir), num_blocks=2048, time=FAST,
                                         max_model_len=8192, max_num_seqs=1, trace=True))
    plain = await start_sim_server(SimConfig(model="sim-model", tokenizer=str(tokenizer_dir), num_blocks=2048, time=FAST,
                                             max_model_len=8192))
    try:
        async with aiohttp.ClientSession() as http:
            async def one(base: str, rid: str) -> None:
                body = {"model": "sim-model", "prompt": LONG_DOC, "max_tokens": 3}
                async with http.post(base + "/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
                    assert r.status == 200
                    await r.read()
            await asyncio.gather(one(s.url, "a-1"), one(s.url, "a-2"))  # one slot: the second waits for the first
            await one(plain.url, "p-1")
            async with http.get(s.url + "/sim/trace?clear=1") as r:
                tr = await r.json()
            async with http.get(s.url + "/sim/trace") as r:
                assert await r.json() == {"max_num_seqs": 1, "requests": [], "steps": []}
            async with http.get(plain.url + "/sim/trace") as r:
                assert await r.json() == {"max_num_seqs": plain.server.cfg.max_num_seqs, "requests": [], "steps": []}
    finally:
        await s.close()
        await plain.close()
    recs = {r["id"]: r for r in tr["requests"]}
    assert set(recs) == {"a-1", "a-2"}
    for r in recs.values():
        assert r["t_arrival"] <= r["t_sched"] < r["t_first"] <= r["t_done"] and r["prompt"] > 500
    first, second = sorted(recs.values(), key=lambda r: r["t_sched"])
    assert second["t_sched"] >= first["t_done"] - 1e-6  # max_num_seqs 1: it waited for the slot
    assert second["cached"] > 0 and first["cached"] == 0  # the same prompt, warm the second time
    assert len(tr["steps"]) >= 4 and all(a <= b for a, b, *_ in tr["steps"])


async def _sse_events(r: aiohttp.ClientResponse) -> list[dict]:
    return [json.loads(line[6:]) for line in (await r.text()).splitlines() if line.startswith("data: ")]


async def test_background_responses_run_on_are_replayed_and_cancelled_as_vllm_does(tokenizer_dir) -> None:
    """vLLM 0.32's background Responses (VLLM_ENABLE_RESPONSES_API_STORE=1): stored as `queued` at
    once and completed whoever listens; a streamed one's events replayed from `starting_after`; a
    running one cancelled (its engine request aborted, the stored status stays `cancelled`); what vLLM
    refuses, refused the same way."""
    sim = await start_sim_server(SimConfig(model="sim-model", tokenizer=str(tokenizer_dir), num_blocks=2048, time=FAST,
                                           max_model_len=8192, responses_store=True))
    url = sim.url + "/v1/responses"
    doc = " ".join(LONG_DOC.split()[:400])

    async def poll(s, rid: str, until: str) -> dict:
        for _ in range(200):
            async with s.get(f"{url}/{rid}") as r:
                got = await r.json()
            if got["status"] == until:
                return got
            await asyncio.sleep(0.02)
        raise AssertionError(f"{rid} never {until}: {got['status']}")

    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json={"input": doc, "max_output_tokens": 4, "background": True}) as r:
                queued = await r.json()
            assert r.status == 200 and queued["status"] == "queued" and queued["output"] == []
            done = await poll(s, queued["id"], "completed")
            assert done["usage"]["output_tokens"] == 4 and done["output"][0]["content"][0]["text"]
            async with s.post(f"{url}/{queued['id']}/cancel") as r:
                assert r.status == 400 and "synchronous" in (await r.json())["error"]["message"]
            async with s.get(f"{url}/{queued['id']}", params={"stream": "true"}) as r:
                assert r.status == 400  # not a streamed background response: nothing to replay

            body = {"input": doc, "max_output_tokens": 3, "background": True, "stream": True}
            async with s.post(url, json=body) as r:
                events = await _sse_events(r)
            rid = events[0]["response"]["id"]
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            assert events[-1]["type"] == "response.completed" and events[-1]["response"]["status"] == "completed"
            async with s.get(f"{url}/{rid}", params={"stream": "true", "starting_after": "2"}) as r:
                assert await _sse_events(r) == events[3:]

            async with s.post(url, json={"input": "a long answer, please", "max_output_tokens": 4000, "background": True}) as r:
                long = await r.json()
            await poll(s, long["id"], "queued")
            for _ in range(200):
                if sim.engine.num_running:
                    break
                await asyncio.sleep(0.01)
            aborted = sim.server.num_aborted_total
            async with s.post(f"{url}/{long['id']}/cancel") as r:
                assert r.status == 200 and (await r.json())["status"] == "cancelled"
            assert sim.server.num_aborted_total == aborted + 1 and sim.engine.num_running == 0
            await asyncio.sleep(0.05)
            assert (await poll(s, long["id"], "cancelled"))["output"] == []

            async with s.post(url, json={"input": "hi", "background": True, "store": False}) as r:
                err = (await r.json())["error"]
                assert r.status == 400 and err["param"] == "background" and "store" in err["message"]
    finally:
        await sim.close()


async def test_a_multimodal_sim_keys_each_image_by_its_content(tokenizer_dir) -> None:
    """`multimodal`: an image is a placeholder keyed by its content, first in its message (where vLLM
    puts it): the same image again is cached past it, another one only up to it; a text-only sim
    refuses images as a text-only vLLM does."""
    s = await start_sim_server(SimConfig(model="sim-model", tokenizer=str(tokenizer_dir), num_blocks=2048, time=FAST,
                                         multimodal=True))
    text_only = await start_sim_server(SimConfig(model="sim-model", tokenizer=str(tokenizer_dir), time=FAST))
    try:
        async with aiohttp.ClientSession() as http:
            async def cached(url: str, image: str) -> tuple[int, dict]:
                body = {"model": "sim-model", "max_tokens": 1, "messages": [
                    {"role": "system", "content": LONG_DOC},
                    {"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                 {"type": "image_url", "image_url": {"url": image}}]}]}
                async with http.post(url + "/v1/chat/completions", json=body) as r:
                    out = await r.json()
                    return r.status, out

            st, a = await cached(s.url, "data:image/png;base64,AAAA")
            assert st == 200 and a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            st, again = await cached(s.url, "data:image/png;base64,AAAA")
            full = (a["usage"]["prompt_tokens"] - 1) // 16 * 16
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == full
            st, other = await cached(s.url, "data:image/png;base64,BBBB")
            assert 0 < other["usage"]["prompt_tokens_details"]["cached_tokens"] < full
            st, refused = await cached(text_only.url, "data:image/png;base64,AAAA")
            assert st == 400 and refused["error"]["param"] == "messages", refused
    finally:
        await s.close()
        await text_only.close()


async def test_n_choices_run_as_child_requests_reported_as_vllm_does(sim) -> None:
    """`n` = 4: four choices; usage counts the prompt once and every child's output; the cached
    tokens are the last child's when answered whole (every full block of the prompt: the first
    child computed them, even cold) and the first child's when streamed (0, cold), as real vLLM
    0.32 reports them (tests/real_vllm/test_vllm_e2e.py)."""
    async with aiohttp.ClientSession() as http:
        for stream in (False, True):
            body = {"model": "sim-model", "prompt": f"stream={stream} " + LONG_DOC, "max_tokens": 3, "n": 4, "stream": stream,
                    **({"stream_options": {"include_usage": True}} if stream else {})}
            async with http.post(sim.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                text = await r.text()
            if stream:
                events = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]
                usage, indexes = events[-1]["usage"], {c["index"] for e in events for c in e["choices"]}
                assert text.rstrip().endswith("data: [DONE]")
            else:
                doc = json.loads(text)
                usage, indexes = doc["usage"], {c["index"] for c in doc["choices"]}
            assert indexes == {0, 1, 2, 3} and usage["completion_tokens"] == 12
            full = (usage["prompt_tokens"] - 1) // 16 * 16
            assert usage["prompt_tokens_details"]["cached_tokens"] == (0 if stream else full), (stream, usage)
        async with http.post(sim.url + "/v1/completions", json={"model": "sim-model", "prompt": "x", "n": 0}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "n"


async def test_a_completions_batch_runs_a_request_per_prompt_reported_as_vllm_does(sim) -> None:
    """A batch [a, b] x n: a choice per prompt and choice (index prompt x n + choice); usage counts
    each prompt once, and a whole answer reports its last prompt's cached tokens, as real vLLM
    0.32 does: [warm a, cold b] reports b's 0, [cold c, warm a] a's every full block."""
    a, b, c = ("batch a " + LONG_DOC, "batch b " + LONG_DOC.replace("fact", "note"), "batch c, other text " + LONG_DOC[:2000])
    async with aiohttp.ClientSession() as http:
        async def complete(prompt, n=1) -> dict:
            body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2, "n": n}
            async with http.post(sim.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                return await r.json()

        first = (await complete(a))["usage"]
        warm_a = (first["prompt_tokens"] - 1) // 16 * 16
        both = await complete([a, b], n=2)
        assert [ch["index"] for ch in both["choices"]] == [0, 1, 2, 3]
        u = both["usage"]
        single_b = (await complete(b))["usage"]["prompt_tokens"]
        assert u["prompt_tokens"] == first["prompt_tokens"] + single_b and u["completion_tokens"] == 8
        assert u["prompt_tokens_details"]["cached_tokens"] == (single_b - 1) // 16 * 16  # b's 2nd child found its 1st's
        last = (await complete([c, a]))["usage"]
        assert last["prompt_tokens_details"]["cached_tokens"] == warm_a
