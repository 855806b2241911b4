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
def tokenizers(tmp_path_factory):
    return {template: build_tokenizer(tmp_path_factory.mktemp(template), template) for template in ("openai", "string")}


@pytest.fixture(scope="module")
def services(tokenizers):
    out = {template: TokenizerService(tok) for template, tok in tokenizers.items()}
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


@pytest.mark.parametrize("template", ["openai", "string"])
def test_the_engine_places_a_messages_items_as_the_gateways_history_units_take_them(services, template):
    """gateway.chat_messages.history_units takes a message's items first for a "string" template
    (vLLM's placeholders lead the message) and in their parts' order for an "openai" one
    (`TokenizerService.media_in_part_order`): in the engine's ids, text sent before an image comes
    after the image's placeholders with the first and before them with the second."""
    svc = services[template]
    assert svc.media_in_part_order() is (template == "openai")
    c = _case(template, "text, image a")
    ids = c["prompt_token_ids"]
    text = next(p["text"] for p in c["messages"][-1]["content"] if p["type"] == "text").strip()
    words = svc.encode_prompt(" " + text.split()[-1], False)  # the text's last word, as it follows a space
    at = max(i for i in range(len(ids)) if ids[i:i + len(words)] == words)  # its last place: the user's text
    first_pad = ids.index(IMAGE_PAD)
    last_pad = len(ids) - 1 - ids[::-1].index(IMAGE_PAD)
    assert (at < first_pad) if template == "openai" else (at > last_pad), (at, first_pad, last_pad)


def test_the_content_format_set_or_interleaving_decides_the_order(tokenizers):
    tok = tokenizers["string"]
    for fmt, interleave, in_order in (("openai", False, True), ("string", True, True)):  # set, on a "string" template
        with TokenizerService(tok, backend="hf", chat_template_content_format=fmt, interleave_mm_strings=interleave) as svc:
            assert svc.media_in_part_order() is in_order, (fmt, interleave)
