"""gateway.parse against vLLM 0.32's own handling of a chat or completions body (fixture made by
tests/real_vllm/request_params_probe.py with vLLM's classes): the chat template's options
(`chat_template_kwargs` merged with `documents`, `reasoning_effort` and the `enable_thinking` it
implies; the request's `add_generation_prompt` / `continue_final_message` over the kwargs'), `n`,
and whether the engine reads its prefix cache for the request (not when it asks for prompt
logprobs: then it reports 0 cached, whatever the index holds)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.parse import parse_request

FIXTURE = json.loads((Path(__file__).parent / "fixtures/vllm-0.32-request-params.json").read_text())
CASES = [c for c in FIXTURE["cases"] if "error" not in c]


def test_the_fixture_covers_each_rule():
    assert FIXTURE["vllm"] == "0.32.0" and len(CASES) >= 20
    assert {c["skip_reading_prefix_cache"] for c in CASES} == {True, False}
    assert any("enable_thinking" in (c.get("chat_template_kwargs") or {}) for c in CASES)
    assert any("documents" in (c.get("chat_template_kwargs") or {}) for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['kind']}-{json.dumps({k: v for k, v in c['body'].items() if k not in ('model', 'messages', 'prompt')}, sort_keys=True)}")
def test_parse_reads_the_body_as_vllm_does(case):
    r = parse_request(case["kind"], case["body"], "m")
    assert r.reads_cache is not case["skip_reading_prefix_cache"] and r.n == case["n"]
    if case["kind"] == "chat":
        rendered = {**(r.chat_template_kwargs or {}), "add_generation_prompt": r.add_generation_prompt,
                    "continue_final_message": r.continue_final_message}
        assert rendered == case["chat_template_kwargs"]
