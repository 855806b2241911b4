"""The request pipeline's stages reached directly, without sockets: parse, decide, rewrite, relay
(idle timeout, truncation, client gone), learn, and dispatch's in-flight accounting on every
failure path."""
from __future__ import annotations

import asyncio
import math
import random

import msgspec
import pytest

import gateway.dispatch as dispatch_mod
from gateway.config import ProxyConfig
from gateway.context import Outcome, ParsedRequest, Prompt, RequestContext, Routing
from gateway.dispatch import Dispatcher
from gateway.encode import tokenize, truncated
from gateway.errors import ApiError, engine_error
from gateway.index import KVIndex
from gateway.learn import learn
from gateway.load import LoadTracker
from gateway.membership import Membership
from gateway.parse import check_context_length, check_model, parse_body, parse_request
from gateway.proxy import Attempt, SseRelay, UpstreamFailure
from gateway.relay import relay, send_whole
from gateway.rewrite import upstream_body
from gateway.routing import SHARE_MIN_NEW_BLOCKS, RoutingState, reported_cached_tokens
from gateway.telemetry import Metrics
from gateway.tracing import NO_SPAN
from gateway.upstream import UpstreamError
from policies.base import Candidate, Decision, PolicyBase, RequestView
from policies.calibration import Calibrator
from policies.registry import get_policy
from replica_agent.feed import FeedEvent, LoadReport

# ----------------------------------------------------------------------------------- parse


def test_parse_refuses_with_the_field_named():
    cases = [
        (b"", "invalid_json", None), (b"[1]", "invalid_json", None), (b"{", "invalid_json", None),
        (b'{"a": "\xff"}', "invalid_encoding", None),
    ]
    for raw, code, _ in cases:
        with pytest.raises(ApiError) as e:
            parse_body(raw)
        assert e.value.status == 400 and e.value.code == code
    with pytest.raises(ApiError) as e:
        check_model({"model": 3}, {"m"}, True)
    assert (e.value.status, e.value.param) == (400, "model")
    with pytest.raises(ApiError) as e:
        check_model({"model": "other"}, {"m"}, True)
    assert (e.value.status, e.value.code) == (404, "model_not_found")
    with pytest.raises(ApiError) as e:
        check_model({"model": "m"}, set(), False)
    assert e.value.status == 503
    bad = [({"messages": []}, "messages"), ({"messages": [{"content": "x"}]}, "messages"),
           ({"messages": [{"role": "user"}], "stream": "yes"}, "stream"),
           ({"messages": [{"role": "user"}], "max_tokens": 0}, "max_tokens"),
           ({"messages": [{"role": "user"}], "max_completion_tokens": True}, "max_tokens"),
           ({"messages": [{"role": "user"}], "chat_template_kwargs": [1]}, "chat_template_kwargs"),
           ({"messages": [{"role": "user"}], "stream_options": 1}, "stream_options"),
           ({"messages": [{"role": "user"}], "n": 0}, "n"), ({"messages": [{"role": "user"}], "n": "2"}, "n"),
           ({"messages": [{"role": "user"}], "n": True}, "n")]
    for payload, param in bad:
        with pytest.raises(ApiError) as e:
            parse_request("chat", payload, "m")
        assert (e.value.status, e.value.param) == (400, param), payload
    for prompt in (None, 5, [], [1, "a", 2.5]):
        with pytest.raises(ApiError) as e:
            parse_request("completions", {"prompt": prompt}, "m")
        assert e.value.param == "prompt"


def test_parse_reads_what_the_gateway_needs():
    r = parse_request("chat", {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                               "stream_options": {"include_usage": True}, "max_completion_tokens": 7,
                               "tools": [{"type": "function"}], "tool_choice": "none"}, "m")
    assert (r.stream, r.client_wants_usage, r.max_tokens, r.tools) == (True, True, 7, None)  # tool_choice none drops tools
    r = parse_request("completions", {"prompt": ["a", [1, 2]], "max_tokens": 3}, "m")
    assert r.prompts == ["a", [1, 2]] and r.max_tokens == 3 and not r.stream
    assert parse_request("completions", {"prompt": [1, 2, 3]}, "m").prompts == [[1, 2, 3]]
    assert parse_request("completions", {"prompt": "a", "n": 4}, "m").n == 4 and r.n == 1


def test_the_cached_tokens_the_engine_will_report_with_n_choices():
    """vLLM's n > 1: a whole answer reports its last child's cached tokens (every full block of the
    prompt, whatever the index held), a stream its first child's (the index's prediction)."""
    rv = RequestView(prompt_tokens=1211, block_size=16)
    assert reported_cached_tokens(rv, 0) == 0 and reported_cached_tokens(rv, 320, choices=1) == 320
    assert reported_cached_tokens(rv, 0, choices=4) == 1200 and reported_cached_tokens(rv, 320, choices=2) == 1200
    assert reported_cached_tokens(rv, 0, choices=4, stream=True) == 0
    aligned = RequestView(prompt_tokens=64, block_size=16)  # the engine computes one token at least
    assert reported_cached_tokens(aligned, 0, choices=8) == 48
    # a completions batch answered whole reports its last prompt's: (its tokens, its blocks found)
    assert reported_cached_tokens(rv, 320, last=(500, 0)) == 0 and reported_cached_tokens(rv, 0, last=(500, 9)) == 144
    assert reported_cached_tokens(rv, 0, last=(161, 99)) == 160
    # streamed, a batch reports whichever prompt's first token came first: not predictable
    assert reported_cached_tokens(rv, 320, last=(500, 0), stream=True) is None
    assert reported_cached_tokens(rv, 0, last=(500, 0), choices=2) == 496
    # prompt logprobs asked: the engine reads no cached block, however many it holds
    assert reported_cached_tokens(rv, 0, choices=4, reads_cache=False) == 0


def test_truncation_keeps_what_vllm_keeps():
    def req(body: dict):
        return parse_request("completions", {"prompt": "x", **body}, "m")

    ids = [1, 10, 11, 12, 13, 14]  # 1: a BOS the tokenizer adds
    assert truncated(ids, req({"truncate_prompt_tokens": 3}), None, (1, 0), text=True) == [1, 13, 14]  # the tokenizer's cut
    assert truncated(ids, req({"truncate_prompt_tokens": 3}), None, (1, 0), text=False) == [12, 13, 14]  # token ids: sliced
    assert truncated(ids, req({"truncate_prompt_tokens": 3, "truncation_side": "left"}), None, (1, 0), text=True) == [12, 13, 14]
    assert truncated(ids, req({"truncate_prompt_tokens": 3, "truncation_side": "right"}), None, (0, 0), text=True) == [1, 10, 11]
    assert truncated(ids, req({"truncate_prompt_tokens": -1}), 5, (0, 0), text=True) == [11, 12, 13, 14]  # the context less one
    assert truncated(ids, req({"truncate_prompt_tokens": -1}), None, (0, 0), text=True) == ids
    assert truncated(ids, req({"truncate_prompt_tokens": 9}), None, (0, 0), text=True) == ids
    assert truncated(ids, req({}), 3, (0, 0), text=True) == ids
    for bad in ({"truncate_prompt_tokens": -2}, {"truncate_prompt_tokens": "3"}, {"truncation_side": "middle"}):
        with pytest.raises(ApiError):
            req(bad)


class CharTok:
    """A tokenizer of one id per character (tokenize's batch path asks encode_prompt_async)."""

    @staticmethod
    def ids(text: str) -> list[int]:
        return [ord(c) for c in text]

    async def encode_prompt_async(self, prompt, add_special_tokens=True):
        return self.encode_prompt(prompt, add_special_tokens)

    def encode_prompt(self, prompt, add_special_tokens=True):
        return self.ids(prompt) if isinstance(prompt, str) else list(prompt)


def test_a_batch_keeps_its_last_prompt_and_what_it_shares_with_the_others():
    tok = CharTok()
    p = asyncio.run(tokenize(tok, parse_request("completions", {"prompt": ["ab" * 100 + "c", "ab" * 100 + "d", "zz"]}, "m"),
                             inline_max_chars=10_000, max_model_len=None))
    assert p.last_ids == tok.ids("zz") and p.last_shared == 0 and p.first_ids == tok.ids("ab" * 100 + "c")
    p = asyncio.run(tokenize(tok, parse_request("completions", {"prompt": ["zz", "ab" * 100 + "c", "ab" * 100 + "d"]}, "m"),
                             inline_max_chars=10_000, max_model_len=None))
    assert p.last_shared == 200 and p.total_tokens == 2 + 201 + 201
    single = asyncio.run(tokenize(tok, parse_request("completions", {"prompt": "ab"}, "m"), inline_max_chars=10_000,
                                  max_model_len=None))
    assert single.last_ids is None and single.last_shared == 0


def test_context_length_uses_vllm_wording():
    check_context_length("chat", 10, 0, 100)
    with pytest.raises(ApiError) as e:
        check_context_length("chat", 90, 20, 100)
    assert e.value.code == "context_length_exceeded" and "110 tokens" in e.value.message and e.value.param == "messages"
    with pytest.raises(ApiError) as e:
        check_context_length("completions", 0, 0, None)
    assert e.value.param == "prompt"


# ----------------------------------------------------------------------------------- rewrite


def test_rewrite_replaces_the_salt_drops_the_engine_priority_and_adds_accounting_options():
    payload = {"model": "alias", "messages": [], "cache_salt": "client-chosen", "stream": True,
               "stream_options": {"continuous_usage_stats": True}, "vllm_xargs": {"x": 1}, "priority": -100}
    req = ParsedRequest("chat", "alias", True, False, 0, messages=[])
    body = msgspec.json.decode(upstream_body(payload, req, salt="S", model_name="real", force_include_usage=True,
                                             kv_cache_report_mode="full"))
    assert body["cache_salt"] == "S" and body["model"] == "real" and "priority" not in body  # no queue jumping
    assert body["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert body["vllm_xargs"] == {"x": 1, "kv_cache_report_mode": "full"}
    body = msgspec.json.decode(upstream_body({"model": "m"}, ParsedRequest("chat", "m", False, False, 0), salt="S",
                                             model_name="m", force_include_usage=True, kv_cache_report_mode=None))
    assert "stream_options" not in body and "vllm_xargs" not in body


def test_engine_errors_are_reshaped():
    e = engine_error(400, b'{"object": "error", "message": "n must be 1", "type": "BadRequestError", "code": 400}')
    assert e.status == 400 and e.message == "n must be 1" and e.code == "engine_error"
    doc = msgspec.json.decode(e.body())
    assert set(doc["error"]) == {"message", "type", "param", "code"} and doc["error"]["type"] == "invalid_request_error"
    e = engine_error(422, b"<html>nope</html>")
    assert "HTTP 422" in e.message and "nope" in e.message


# ----------------------------------------------------------------------------------- decide


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _state(clock) -> RoutingState:
    return RoutingState(KVIndex(clock=clock, stale_after_s=5.0), LoadTracker(), Calibrator(), speculative_ttl_s=2.0,
                        clock=clock)


def test_decide_follows_the_index_and_its_clock():
    clock = _Clock()
    st = _state(clock)
    keys = list(range(1, 41))
    st.index.apply(FeedEvent("b", 1, "stored", tuple(keys)))
    st.index.apply(FeedEvent("b", 2, "load", (), load=LoadReport(0, 0, 0.1, 0.0, 0.0, 1000, 16, 0.0)))
    rv = RequestView(prompt_tokens=641, block_size=16, keys=tuple(keys))
    pol = get_policy("cache_aware")
    r = st.decide(rv, {"a": True, "b": True}, pol, random.Random(0))
    assert r.decision.winner == "b" and r.view_of("b").matched_blocks_gpu == 40
    assert r.view_of("b").kv_cached_frac == pytest.approx(0.04)
    assert r.view_of("b").kv_capacity_blocks == 1000
    clock.t += 6.0  # b's feed went silent: its matches stop counting
    r = st.decide(rv, {"a": True, "b": True}, pol, random.Random(0))
    assert r.view_of("b").index_live is False
    # an unavailable replica is never ranked
    r = st.decide(rv, {"a": False, "b": True}, pol, random.Random(0))
    assert [c.replica_id for c in r.decision.ranked] == ["b"]


def test_dispatched_counts_work_and_speculates_until_the_ttl():
    clock = _Clock()
    st = _state(clock)
    f = st.dispatched("a", [7, 8, 9], 300, 16)
    ld = st.load.get("a")
    assert (ld.inflight_reqs, ld.inflight_tokens) == (1, 300)
    assert st.index.match([7, 8, 9])["a"].gpu_blocks == 3
    clock.t += 2.5
    assert "a" not in st.index.match([7, 8, 9])
    f.first_token()
    f.finish()
    ld = st.load.get("a")
    assert (ld.inflight_reqs, ld.active_reqs) == (0, 0)


def test_long_new_prefixes_are_shared_with_the_other_gateways_until_their_ttl():
    """A dispatch that brings a replica SHARE_MIN_NEW_BLOCKS or more blocks it is not known to hold
    is queued for the other gateways (with the TTL left when taken); a shorter new tail is not; an
    applied entry counts on the receiving gateway's index like its own speculation."""
    clock = _Clock()
    st, other = _state(clock), _state(clock)
    st.share_copies = True
    doc = list(range(1, SHARE_MIN_NEW_BLOCKS + 9))  # 8 held + the threshold
    st.index.apply(FeedEvent("a", 1, "stored", tuple(doc[:8])))  # a holds the first 8 blocks
    rv = RequestView(prompt_tokens=16 * len(doc), block_size=16, keys=tuple(doc))
    held = st.decide(rv, {"a": True}, get_policy("cache_aware"), random.Random(0)).view_of("a")
    st.dispatched("a", doc, 16 * SHARE_MIN_NEW_BLOCKS, 16, held)  # exactly the threshold of new blocks
    st.dispatched("b", doc[:SHARE_MIN_NEW_BLOCKS - 1], 16, 16)  # one block short: stays ours
    clock.t += 0.5
    taken = st.take_shared()
    assert [(rid, len(keys)) for rid, keys, _ in taken] == [("a", len(doc))]
    # speculative_ttl_s plus the request's own prefill there, less the time it waited to be taken
    assert taken[0][2] == pytest.approx(2.0 + 16 * SHARE_MIN_NEW_BLOCKS * held.prefill_s_per_token - 0.5)
    assert st.take_shared() == []  # taken once
    assert "a" not in other.index.match(doc)
    other.apply_shared(taken)
    assert other.index.match(doc)["a"].gpu_blocks == len(doc)
    clock.t += 1.6
    assert "a" not in other.index.match(doc)  # its TTL ran out there too
    st.dispatched("a", list(range(100, 200)), 1600, 16)
    clock.t += 3.0
    assert st.take_shared() == []  # expired before it was taken
    quiet = _state(clock)  # share_copies off (no feed): nothing is queued
    quiet.dispatched("a", doc, 1000, 16)
    assert quiet.take_shared() == []


def test_a_sharing_policys_placements_are_queued_and_applied_elsewhere():
    """With a feed, the record cache_plan's placed() returns is queued once for the other
    gateways, whose instance applies it (a malformed one, another version's, is skipped); a policy
    that shares nothing (cache_aware) queues nothing, nor does a gateway without a feed."""
    clock = _Clock()
    st, other, quiet = _state(clock), _state(clock), _state(clock)
    st.share_copies = other.share_copies = True
    doc = list(range(1, 41))
    for s_ in (st, quiet):
        s_.index.apply(FeedEvent("a", 1, "stored", tuple(doc)))
        s_.index.apply(FeedEvent("b", 1, "load", (), load=LoadReport(0, 0, 0.1, 0.0, 0.0, 1000, 16, 0.0)))
    rv = RequestView(prompt_tokens=16 * 42, block_size=16, keys=tuple(doc) + (98, 99))
    plan, there, aware = get_policy("cache_plan"), get_policy("cache_plan"), get_policy("cache_aware")
    r = st.decide(rv, {"a": True, "b": True}, plan, random.Random(0))
    assert r.decision.ranked[0].terms["plan"] == 1.0 and r.decision.winner == "a"
    st.placed(plan, rv, r.decision)
    st.placed(aware, rv, st.decide(rv, {"a": True, "b": True}, aware, random.Random(0)).decision)
    records = st.take_placements()
    assert len(records) == 1 and records[0][0] == doc[39] and records[0][2] == "a"  # its root, where it went
    assert st.take_placements() == []  # taken once
    assert other.apply_placements(there, records + [["not", "a", "record"]]) == 1
    assert (st.placements_traded, other.placements_traded) == (
        {"sent": 1, "applied": 0, "skipped": 0}, {"sent": 0, "applied": 1, "skipped": 1})
    assert there.load_share("a") > 0.0 and there.load_share("a") == pytest.approx(plan.load_share("a"))
    r = quiet.decide(rv, {"a": True, "b": True}, get_policy("cache_plan"), random.Random(0))
    quiet.placed(get_policy("cache_plan"), rv, r.decision)
    assert quiet.take_placements() == []  # no feed: nothing queued


def test_keep_alives_refreshes_and_the_plans_placements_count_as_uses_in_the_other_gateways_retainers():
    """With keep-alive on, a refresh one gateway sent travels with its placements; the other
    gateway's retainer counts it, and each placement of a root it keeps, as a use there (so the
    root is not due there too), and its policy never sees the refresh record."""
    from gateway.keepalive import KeepAlive, Retainer
    from gateway.routing import REFRESH_RECORD

    clock = _Clock()
    st, other = _state(clock), _state(clock)
    st.share_copies = other.share_copies = True
    doc = list(range(1, 101))
    st.index.apply(FeedEvent("a", 1, "stored", tuple(doc)))
    st.index.apply(FeedEvent("b", 1, "load", (), load=LoadReport(0, 0, 0.1, 0.0, 0.0, 1000, 16, 0.0)))
    rv = RequestView(prompt_tokens=16 * 102, block_size=16, keys=tuple(doc) + (998, 999))
    plan, there = get_policy("cache_plan"), get_policy("cache_plan")
    st.placed(plan, rv, st.decide(rv, {"a": True, "b": True}, plan, random.Random(0)).decision)
    st.refreshed("a", doc[99], 0.25)
    records = st.take_placements()
    assert records[-1] == [REFRESH_RECORD, "a", doc[99], 0.25] and len(records) == 2
    assert st.placements_traded["sent"] == 1  # placements only
    kept = Retainer(KeepAlive(idle_s=1.0, min_blocks=64))
    kept.used("a", rv.keys, 100, t=0.0, payload=lambda: ("ids", "salt"))
    # the first batch a gateway reads is the feed's kept history, of unknown age: the plan's, not the retainer's
    late, there_late = _state(clock), get_policy("cache_plan")
    assert late.apply_placements(there_late, records, kept, now=0.5) == 1 and there_late.load_share("a") > 0.0
    assert late.refreshes_traded["heard"] == 0 and late.others_heard_at == -math.inf
    assert kept.kept["a"][doc[99]].used == 0.0 and kept.kept["a"][doc[99]].rival == math.inf
    assert len(kept.due(1.1, lambda r, k: len(k), lambda r: 1000)) == 1  # idle here: due
    kept = Retainer(KeepAlive(idle_s=1.0, min_blocks=64))
    kept.used("a", rv.keys, 100, t=0.0, payload=lambda: ("ids", "salt"))
    other.apply_placements(there, [], kept)  # its first read: no history
    assert other.others_heard_at == -math.inf  # nothing from another gateway yet
    assert other.apply_placements(there, records, kept, now=0.5) == 1
    assert other.others_heard_at == clock.t and other.refreshes_traded == {"sent": 0, "heard": 1}
    assert other.placements_traded == {"sent": 0, "applied": 1, "skipped": 0}
    e = kept.kept["a"][doc[99]]
    assert e.used == 0.5 and e.requested == 0.5 and e.rival == 0.25  # the request, then the refresh
    assert kept.due(1.1, lambda r, k: len(k), lambda r: 1000) == []  # used elsewhere 0.6 s ago
    assert there.load_share("a") == pytest.approx(plan.load_share("a"))  # the refresh is not a placement
    st.refreshed("b", doc[99], 0.25)
    other.apply_placements(there, st.take_placements() + [[REFRESH_RECORD, "a", doc[99], "x"]], kept, now=1.0)
    assert set(kept.kept) == {"a"} and kept.kept["a"][doc[99]].used == 0.5  # b: not kept here; a bad rank: skipped
    quiet = _state(clock)  # no feed: nothing queued
    quiet.refreshed("a", doc[99], 0.25)
    assert quiet.take_placements() == []


# ----------------------------------------------------------------------------------- learn


class _Observer(PolicyBase):
    name = "observer"

    def __init__(self) -> None:
        self.seen = []

    def observe(self, replica_id, ttft_s, uncached_tokens):
        self.seen.append((replica_id, ttft_s, uncached_tokens))


def _outcome(**kw):
    base = dict(replica_id="r", ttft_s=0.5, predicted_cached_tokens=96, uncached_tokens=500, backlog_tokens=0.0,
                running_reqs=0, usage={"prompt_tokens": 600, "completion_tokens": 4,
                                       "prompt_tokens_details": {"cached_tokens": 64}}, decode_step_s=0.02)
    base.update(kw)
    return Outcome(**base)


def test_learn_uses_the_engines_numbers_when_it_has_them():
    cal, pol = Calibrator(min_samples=1), _Observer()
    lesson = learn(_outcome(), cal, pol)
    assert (lesson.prompt_tokens, lesson.cached_tokens, lesson.uncached_tokens) == (600, 64, 536)
    assert pol.seen == [("r", 0.5, 536)]
    assert cal.prefill_s_per_token("r") == pytest.approx(0.5 / 536)
    assert cal.decode_step_s("r") == pytest.approx(0.02)
    # a whole answer: no rate sample; no usage: the prediction stands in
    cal2, pol2 = Calibrator(min_samples=1), _Observer()
    lesson = learn(_outcome(ttft_s=None, usage=None, decode_step_s=None), cal2, pol2)
    assert lesson.cached_tokens is None and lesson.uncached_tokens == 500 and pol2.seen == []
    assert cal2.prefill_s_per_token("r") == Calibrator().prefill_s_per_token("r")  # still the prior


def test_an_answer_without_a_prediction_is_no_evidence_of_the_index():
    """A streamed batch has no prediction (routing.reported_cached_tokens): its usage is counted,
    its rates learnt, but neither the accuracy metrics nor the index check take it as evidence."""
    lesson = learn(_outcome(predicted_cached_tokens=None), Calibrator(min_samples=1), _Observer())
    m = Metrics()
    assert m.record_lesson(lesson) is None and lesson.cached_tokens == 64 and lesson.uncached_tokens == 536
    assert m.record_lesson(learn(_outcome(), Calibrator(), _Observer())) == pytest.approx(64 / 96)


# ----------------------------------------------------------------------------------- relay


class FakeClient:
    """The FrontResponse surface the relay uses; records what the client received."""

    def __init__(self, gone_after: int | None = None) -> None:
        self.data = b""
        self.status = None
        self.ended = False
        self.flow = None
        self.gone_after = gone_after  # raise ConnectionResetError on this write

    def _check(self):
        if self.gone_after is not None:
            self.gone_after -= 1
            if self.gone_after < 0:
                raise ConnectionResetError("client gone")

    async def send(self, status, headers, body):
        self._check()
        self.status, self.headers, self.data, self.ended = status, headers, body, True

    async def start(self, status, headers, first=b"", *, end=False):
        self._check()
        self.status, self.headers = status, headers
        self.data += first
        self.ended = end

    def on_flow(self, pause, resume):
        self.flow = (pause, resume) if pause else None

    def write_nowait(self, data):
        self.data += data

    def end_nowait(self, last=b""):
        self.data += last
        self.ended = True

    async def write(self, data):
        self._check()
        self.data += data

    async def end(self, last=b""):
        self.data += last
        self.ended = True


class FakeUpstream:
    """The UpstreamResponse surface the relay uses; the test pushes chunks through `sink`."""

    def __init__(self) -> None:
        self.sink = None
        self.closed = False
        self.released = False

    def pipe(self, on_data, on_end):
        self.sink = (on_data, on_end)

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def close(self):
        self.closed = True

    def release(self):
        self.released = True
        self.closed = True


def _stream_attempt(first: bytes, up: FakeUpstream) -> Attempt:
    r = SseRelay(client_wants_usage=False)
    out = r.feed(first)
    return Attempt(200, "text/event-stream", up, out, r, 0.0, 0.0)


EV = b'data: {"choices": [{"text": "x"}]}\n\n'
USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}\n\n'


async def test_relay_whole_stream_strips_usage_and_reports_it():
    up = FakeUpstream()
    at = _stream_attempt(EV, up)
    client = FakeClient()
    task = asyncio.create_task(relay(client, at, {}, idle_timeout_s=5.0))
    await asyncio.sleep(0)
    on_data, on_end = up.sink
    on_data(EV + EV)
    on_data(USAGE + b"data: [DONE]\n\n")
    on_end(None)
    r = await task
    assert r.error is None and not r.client_gone and r.usage["completion_tokens"] == 3
    assert client.data == EV * 3 + b"data: [DONE]\n\n" and client.ended and up.released
    assert r.decode_step_s is not None and client.flow is None


async def test_relay_idle_timeout_ends_the_stream_with_an_error_and_aborts_the_engine():
    up = FakeUpstream()
    client = FakeClient()
    r = await asyncio.wait_for(relay(client, _stream_attempt(EV, up), {}, idle_timeout_s=0.05), 2.0)
    assert r.error == "idle timeout" and up.closed and not up.released
    assert b"sent nothing for 0.05s" in client.data and client.data.endswith(b"data: [DONE]\n\n") and client.ended


async def test_relay_truncated_stream_says_so():
    up = FakeUpstream()
    client = FakeClient()
    task = asyncio.create_task(relay(client, _stream_attempt(EV, up), {}, idle_timeout_s=5.0))
    await asyncio.sleep(0)
    up.sink[0](b'data: {"partial')
    up.sink[1](None)  # body ended without [DONE]
    r = await task
    assert r.error == "truncated" and b'data: {"partial' in client.data and b"without [DONE]" in client.data


async def test_relay_upstream_failure_mid_stream():
    up = FakeUpstream()
    client = FakeClient()
    task = asyncio.create_task(relay(client, _stream_attempt(EV, up), {}, idle_timeout_s=5.0))
    await asyncio.sleep(0)
    up.sink[1](UpstreamError("io", "connection lost"))
    r = await task
    assert r.error == "connection lost" and b"failed mid-stream (connection lost)" in client.data


async def test_relay_client_gone_closes_the_upstream():
    up = FakeUpstream()
    client = FakeClient(gone_after=0)  # the very first send fails
    r = await relay(client, _stream_attempt(EV, up), {}, idle_timeout_s=5.0)
    assert r.client_gone and up.closed and not up.released


async def test_send_whole_reshapes_engine_errors():
    client = FakeClient()
    at = Attempt(400, "application/json", None, b'{"error": {"message": "bad n", "type": "BadRequestError", "param": "n", "code": 400}}',
                 None, 0.0, 0.0)
    r = await send_whole(client, at, {"X-Request-Id": "q"})
    doc = msgspec.json.decode(client.data)
    assert client.status == 400 and doc["error"]["message"] == "bad n" and doc["error"]["param"] == "n"
    assert doc["error"]["type"] == "invalid_request_error" and r.usage is None


# ----------------------------------------------------------------------------------- dispatch


class _Pool:
    pass


def _ctx(ranked) -> RequestContext:
    req = ParsedRequest("chat", "m", True, False, 8, messages=[])
    rv = RequestView(prompt_tokens=100, block_size=16, keys=(1, 2, 3))
    routing = Routing(rv, (), Decision("t", tuple(Candidate(r, 0.0, {}) for r in ranked)), 0.0)
    ctx = RequestContext("q", "/v1/chat/completions", "chat", {}, 0.0, request=req, routing=routing,
                         prompt=Prompt([0] * 100, 100, 0.0), keys=[1, 2, 3], body=b"{}", span=NO_SPAN)
    return ctx


@pytest.mark.parametrize("failure", ["refused_then_ok", "all_refused", "answer_raises", "cancelled", "client_gone"])
async def test_dispatch_leaves_no_inflight_count_behind(monkeypatch, failure):
    clock = _Clock()
    st = _state(clock)
    mem = Membership()
    mem.set_members({"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"})
    d = Dispatcher(_Pool(), mem, st, Metrics(), ProxyConfig())
    calls = []

    async def fake_attempt(pool, base_url, path, body, headers, **kw):
        calls.append(base_url)
        if failure == "all_refused" or (failure == "refused_then_ok" and len(calls) == 1):
            raise UpstreamFailure("connect", "connection refused")
        if failure == "cancelled":
            raise asyncio.CancelledError()
        return Attempt(200, "application/json", None, b"{}", None, 0.0, 0.0)

    async def answer(ctx, at, up_span):
        assert st.load.get(ctx.replica).inflight_reqs == 1  # counted while answering
        ctx.attempt.flight.first_token()
        if failure == "answer_raises":
            raise RuntimeError("relay bug")
        if failure == "client_gone":
            raise ConnectionResetError()
        return 200

    monkeypatch.setattr(dispatch_mod, "attempt", fake_attempt)
    ctx = _ctx(["a", "b"])
    if failure == "refused_then_ok":
        assert await d.run(ctx, answer) == 200 and ctx.replica == "b" and len(calls) == 2
        assert not mem.available("a")  # ejected
    else:
        exc = {"all_refused": ApiError, "answer_raises": RuntimeError, "cancelled": asyncio.CancelledError,
               "client_gone": ConnectionResetError}[failure]
        with pytest.raises(exc):
            await d.run(ctx, answer)
    for rid in ("a", "b"):
        ld = st.load.get(rid)
        assert (ld.inflight_reqs, ld.inflight_tokens, ld.active_reqs) == (0, 0, 0), (failure, rid)


async def test_dispatch_exhausted_answers_by_the_last_failure(monkeypatch):
    st = _state(_Clock())
    mem = Membership()
    mem.set_members({"a": "http://127.0.0.1:1"})
    d = Dispatcher(_Pool(), mem, st, Metrics(), ProxyConfig())

    async def timeout_attempt(*a, **kw):
        raise UpstreamFailure("first_byte", "timeout")

    monkeypatch.setattr(dispatch_mod, "attempt", timeout_attempt)
    with pytest.raises(ApiError) as e:
        await d.run(_ctx(["a"]), None)
    assert e.value.status == 504 and e.value.headers["Retry-After"] == "1"
    with pytest.raises(ApiError) as e:
        await d.run(_ctx(["gone"]), None)  # left the pool since the decision: nothing tried
    assert e.value.status == 503


@pytest.mark.parametrize("lora, listed_on_a, ranked, expect", [
    ("dyn", True, ["a", "b"], (200, ["a", "b"], {"b"})),  # a unloaded it: dropped there, b answers
    ("dyn", True, ["a"], (404, ["a"], {"b"})),  # nobody left to try: dropped there, the client gets the 404
    ("dyn", False, ["a", "b"], (404, ["a"], {"b"})),  # a never listed it: its 404 is the answer
    (None, True, ["a", "b"], (404, ["a"], {"a", "b"})),  # the base model's 404 is the engine's answer
])
async def test_dispatch_a_404_for_a_listed_adapter_tries_the_next_holder(monkeypatch, lora, listed_on_a, ranked, expect):
    from gateway.model import ModelInfo

    st = _state(_Clock())
    mem = Membership()
    mem.set_members({"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"})
    model = ModelInfo("m", [], 16, 4096)
    model.set_listed("a", ["dyn"] if listed_on_a else [])
    model.set_listed("b", ["dyn"])
    d = Dispatcher(_Pool(), mem, st, Metrics(), ProxyConfig(), model)
    calls = []

    async def fake_attempt(pool, base_url, path, body, headers, **kw):
        calls.append({"http://127.0.0.1:1": "a", "http://127.0.0.1:2": "b"}[base_url])
        status = 404 if calls[-1] == "a" else 200
        return Attempt(status, "application/json", None, b"{}", None, 0.0, 0.0)

    async def answer(ctx, at, up_span):
        return at.status

    monkeypatch.setattr(dispatch_mod, "attempt", fake_attempt)
    ctx = _ctx(ranked)
    ctx.lora = lora
    status = await d.run(ctx, answer)
    assert (status, calls, set(model.replicas_for("dyn"))) == expect
    assert mem.available("a")  # a 404 is an answer, not a failure: nothing ejected
    for rid in ("a", "b"):
        assert st.load.get(rid) is None or st.load.get(rid).inflight_reqs == 0
