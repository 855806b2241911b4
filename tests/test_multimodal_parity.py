"""A chat with images, the gateway's tokens against real vLLM's: `tests/fixtures/vllm-0.32-multimodal.json`
(made by `tests/real_vllm/multimodal_probe.py` on a tiny random-weight Qwen2-VL, block size 32, each
template's cases in order on a fresh engine) holds the engine's prompt ids (`return_token_ids`) and
the cached tokens it reported. For a template that renders each part in its place ("openai") and
one that takes the content as a string (vLLM then puts the placeholders first in the message), the
gateway's ids (gateway.chat_messages: the text before the first media item) are the engine's up to
that item's first token, and what the engine's prefix cache found for a new image after a held
prompt is exactly the full blocks before the image's first placeholder token (`<|image_pad|>`: its
`<|vision_start|>` is plain text), at most one block more than the gateway's ids fill."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.chat_messages import has_media
from gateway.tokenization import TokenizerService
from tests.real_vllm.multimodal_probe import IMAGE_PAD, VISION_START, build_tokenizer

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "vllm-0.32-multimodal.json").read_text())
BS = FIXTURE["block_size"]


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    out = {}
    for template in ("openai", "string"):
        out[template] = TokenizerService(build_tokenizer(tmp_path_factory.mktemp(template), template))
    yield out
    for s in out.values():
        s.close()


def _case(template: str, label: str) -> dict:
    return next(c for c in FIXTURE["cases"] if c["template"] == template and c["label"] == label)


@pytest.mark.parametrize("template", ["openai", "string"])
def test_the_gateways_ids_are_the_engines_up_to_the_first_media_item(services, template):
    cases = [c for c in FIXTURE["cases"] if c["template"] == template]
    assert len(cases) >= 7 and any(has_media(c["messages"]) for c in cases)
    for c in cases:
        ours, theirs = services[template].encode_chat(c["messages"]), c["prompt_token_ids"]
        if not has_media(c["messages"]):
            assert ours == theirs, c["label"]
            continue
        assert theirs[:len(ours)] == ours and theirs[len(ours)] == VISION_START, (c["label"], len(ours))
        assert theirs.index(IMAGE_PAD) == len(ours) + 1, c["label"]


@pytest.mark.parametrize("template", ["openai", "string"])
def test_what_the_engine_finds_before_an_image_is_what_the_gateway_keys(services, template):
    def ours(label):
        return len(services[template].encode_chat(_case(template, label)["messages"]))

    for label in ("image b, text", "text, image a"):  # a new image after a held prompt: its text prefix
        c = _case(template, label)
        first_pad = c["prompt_token_ids"].index(IMAGE_PAD)
        assert c["cached_tokens"] == first_pad // BS * BS, label
        assert ours(label) // BS * BS <= c["cached_tokens"] <= ours(label) // BS * BS + BS, label
    again = _case(template, "image a, text, again")  # the same image again: cached past it (not predicted)
    assert again["cached_tokens"] == (len(again["prompt_token_ids"]) - 1) // BS * BS
    text = _case(template, "text only")  # a text prompt shares the blocks before the image
    assert text["cached_tokens"] == ours("image a, text") // BS * BS


@pytest.mark.parametrize("template", ["openai", "string"])
def test_what_the_gateway_learns_an_image_takes_counts_the_engines_next_prompts(services, template):
    """gateway.encode's load estimate of a chat with images: its ids, the text after the first item
    and, per item, what the engine's first answer said an item takes (its prompt's length less the
    gateway's text): on these same-sized images, every other prompt's length exactly, or within one
    token where a "string" template puts two placeholders a line each (the gateway's lines merge)."""
    import asyncio

    from gateway.context import Prompt
    from gateway.encode import MediaTokens

    media = MediaTokens()
    cases = [c for c in FIXTURE["cases"] if c["template"] == template and has_media(c["messages"])]
    assert len(cases) >= 5
    for i, c in enumerate(cases):
        ids, after, items = asyncio.run(services[template].encode_chat_cut(c["messages"], inline_max_chars=10_000))
        assert items == sum(isinstance(p, dict) and p.get("type") == "image_url" for m in c["messages"]
                            if isinstance(m["content"], list) for p in m["content"]), c["label"]
        engine = len(c["prompt_token_ids"])
        if i:  # estimated before this answer is learned from
            assert abs(len(ids) + after + media.estimate(items) - engine) <= (items > 1 and template == "string"), c["label"]
        media.observe(Prompt(ids, engine, 0.0, cut=True, after_cut=after, media_items=items), engine)
    assert media.answers == len(cases)
