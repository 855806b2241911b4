"""The Responses API read as vLLM reads it (gateway.responses_api), pure: every body of the fixture
gives the messages, tools and template options vLLM 0.32's own functions gave; what the gateway
refuses it refuses in OpenAI's shape; the relay reads a Responses stream (its first token, its end,
its usage) and the learner its usage."""
from __future__ import annotations

import copy
import json

import pytest

from gateway.context import RESPONSES
from gateway.errors import ApiError
from gateway.learn import usage_numbers
from gateway.parse import parse_request
from gateway.proxy import SseRelay
from gateway.responses_api import kept_messages, output_messages, parse_responses, with_history
from gateway.rewrite import upstream_body
from tests.conftest import REPO

FIXTURE = json.loads((REPO / "tests/fixtures/vllm-0.32-responses-render.json").read_text())


def _ids(cases):
    return [f"{i}:{json.dumps(c['body'])[:60]}" for i, c in enumerate(cases)]


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_ids(FIXTURE["cases"]))
def test_every_body_renders_as_vllm_renders_it(case):
    body = copy.deepcopy(case["body"])
    if "error" in case:
        if case["error"] == "ValidationError":  # the request's shape: the engine's 400, whatever the gateway read
            return
        with pytest.raises(ApiError) as e:  # vLLM's own refusal while building the messages: ours too
            parse_request(RESPONSES, body, body["model"])
        assert e.value.status == 400 and e.value.param == "input"
        return
    req = parse_request(RESPONSES, body, body["model"])
    assert req.messages == case["messages"]
    assert req.tools == case["tools"]
    want = dict(case["chat_template_kwargs"])
    assert (req.add_generation_prompt, req.continue_final_message) == (want.pop("add_generation_prompt"),
                                                                       want.pop("continue_final_message"))
    assert (req.chat_template_kwargs or {}) == want
    assert body == case["body"]  # the client's body is untouched (it goes upstream as sent)


@pytest.mark.parametrize("case", FIXTURE["followups"], ids=_ids(FIXTURE["followups"]))
def test_every_follow_up_renders_its_stored_history_as_vllm_does(case):
    """What the gateway records of a stored response (its messages bar the system ones, its
    answer's text parts) put before the new turn: vLLM's messages for the follow-up."""
    body, prev = copy.deepcopy(case["body"]), case["previous"]
    req = parse_request(RESPONSES, body, body["model"], stored_responses=True)
    assert req.previous_response_id == body["previous_response_id"]
    history = kept_messages(prev["messages"]) + output_messages(prev["output"])
    assert with_history(req, body, history).messages == case["messages"]
    assert body == case["body"]


def test_the_fixture_covers_what_the_rules_name():
    bodies = json.dumps([c["body"] for c in FIXTURE["cases"]])
    for needle in ('"instructions"', '"function_call"', '"function_call_output"', '"reasoning"', '"namespace"',
                   '"in_progress"', '"incomplete"', '"encrypted_content"', '"web_search"', '"strict"', '"effort"'):
        assert needle in bodies, needle
    assert sum("error" in c for c in FIXTURE["cases"]) >= 3 and FIXTURE["vllm"] == "0.32.0"
    followups = json.dumps(FIXTURE["followups"])
    for needle in ('"reasoning"', '"function_call"', '"instructions"', '"incomplete"', '"developer"', '"output": []'):
        assert needle in followups, needle
    assert not any("error" in c for c in FIXTURE["followups"])


@pytest.mark.parametrize("body,param,stored", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", False),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", False),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", True),
    ({"input": "hi", "background": True}, "background", False),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt", False),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt", True),
])
def test_what_one_engine_holds_is_refused_clearly(body, param, stored):
    with pytest.raises(ApiError) as e:
        parse_request(RESPONSES, {"model": "m", **body}, "m", stored_responses=stored)
    assert (e.value.status, e.value.code, e.value.param) == (400, "unsupported_parameter", param)
    assert "not supported through this gateway" in e.value.message
    assert ("responses.store" in e.value.message) == (param in ("previous_response_id", "background"))


def test_with_the_store_a_follow_up_and_a_background_response_are_read():
    req = parse_request(RESPONSES, {"model": "m", "input": "hi", "previous_response_id": "resp_1", "background": True},
                        "m", stored_responses=True)
    assert req.previous_response_id == "resp_1" and req.messages == [{"role": "user", "content": "hi"}]
    for bad in (3, "", "x" * 257, ["resp_1"]):
        with pytest.raises(ApiError) as e:
            parse_request(RESPONSES, {"model": "m", "input": "hi", "previous_response_id": bad}, "m", stored_responses=True)
        assert e.value.status == 400 and e.value.param == "previous_response_id"


@pytest.mark.parametrize("body,param", [
    ({}, "input"), ({"input": []}, "input"), ({"input": 3}, "input"), ({"input": ["text"]}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c"}]}, "input"),
    ({"input": "hi", "stream": "yes"}, "stream"), ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "instructions": 1}, "instructions"), ({"input": "hi", "tools": {"type": "function"}}, "tools"),
    ({"input": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"input": "hi", "chat_template_kwargs": []}, "chat_template_kwargs"),
])
def test_bad_bodies_name_the_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_request(RESPONSES, {"model": "m", **body}, "m")
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_the_engine_body_keeps_the_responses_shape():
    payload = {"model": "alias", "input": "hi", "stream": True, "cache_salt": "client-chosen", "priority": -5}
    req = parse_request(RESPONSES, payload, "alias")
    assert req.stream and req.client_wants_usage and req.max_tokens == 0
    out = json.loads(upstream_body(payload, req, salt="derived", model_name="m", force_include_usage=True,
                                   kv_cache_report_mode=None, engine_priority=1))
    assert out == {"model": "m", "input": "hi", "stream": True, "cache_salt": "derived", "priority": 1}


def _ev(kind: str, **fields) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


USAGE = {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 3, "total_tokens": 43}
STREAM = (_ev("response.created", response={"id": "resp_1"}) + _ev("response.in_progress", response={"id": "resp_1"})
          + _ev("response.output_item.added", output_index=0) + _ev("response.output_text.delta", delta="a")
          + _ev("response.output_text.delta", delta="b") + _ev("response.output_text.delta", delta="c")
          + _ev("response.output_text.done", text="abc")
          + _ev("response.completed", response={"id": "resp_1", "usage": USAGE}))


@pytest.mark.parametrize("cut", [1, 7, 50, 97, 200, len(STREAM) - 5])
def test_the_relay_holds_the_preamble_until_the_first_token(cut):
    t = iter(range(100))
    relay = SseRelay(True, clock=lambda: float(next(t)))
    first = relay.feed(STREAM[:cut])
    while not first and cut < len(STREAM):  # as `attempt` reads until the first bytes out
        nxt = min(cut + 40, len(STREAM))
        first, cut = relay.feed(STREAM[cut:nxt]), nxt
    assert first.startswith(b"event: response.created") and b"response.output_text.delta" in first
    rest = relay.feed(STREAM[cut:]) if cut < len(STREAM) else b""
    assert first + rest + relay.tail() == STREAM  # nothing dropped, nothing reordered
    assert relay.done and relay.usage == USAGE and relay.content_events == 3
    assert usage_numbers(relay.usage) == (40, 3, 32)


def test_a_response_without_tokens_is_released_at_its_end_and_a_cut_one_by_tail():
    relay = SseRelay(True)
    head = _ev("response.created", response={}) + _ev("response.in_progress", response={})
    assert relay.feed(head) == b""
    end = _ev("response.completed", response={"usage": USAGE})
    assert relay.feed(end) == head + end and relay.done and relay.content_events == 0
    cut = SseRelay(True)
    assert cut.feed(head) == b"" and cut.tail() == head and not cut.done


def test_chat_streams_are_untouched_by_the_responses_rules():
    relay = SseRelay(False)
    chunk = b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
    assert relay.feed(chunk) == chunk and relay.content_events == 1
    assert relay.feed(b'data: {"choices": [], "usage": {"prompt_tokens": 5}}\n\ndata: [DONE]\n\n') == b"data: [DONE]\n\n"
    assert relay.done and relay.usage == {"prompt_tokens": 5}


def test_truncation_auto_is_vllms_cut_to_the_context():
    assert parse_responses({"input": "hi", "truncation": "auto"}, "m").truncate == -1
    assert parse_responses({"input": "hi", "truncation": "disabled"}, "m").truncate is None
    assert parse_responses({"input": "hi"}, "m").truncate is None
    with pytest.raises(ApiError) as e:
        parse_responses({"input": "hi", "truncation": "middle"}, "m")
    assert e.value.param == "truncation"
