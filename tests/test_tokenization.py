"""gateway.tokenization: exact parity with plain transformers and with the real engine's /tokenize.

The reference everywhere is the plain `AutoTokenizer` of the same directory: `tok(prompt,
add_special_tokens=True)` for completions and `apply_chat_template(conversation,
add_generation_prompt=..., tokenize=True)` for chats, where `conversation` is what vLLM hands to
the template (text parts joined with "\\n" for string-format templates).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import ApiError
from gateway.token_backends import segment_safe as _segment_safe
from gateway.tokenization import (
    SegmentCache,
    TokenizationError,
    TokenizerService,
    detect_content_format,
)

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


@pytest.fixture(scope="module")
def hf(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="module")
def svc(tokenizer_dir):
    s = TokenizerService(tokenizer_dir, max_workers=2)
    yield s
    s.close()


@pytest.fixture(scope="module")
def svc_nocache(tokenizer_dir):
    s = TokenizerService(tokenizer_dir, segment_cache_entries=0)
    yield s
    s.close()


@pytest.fixture(scope="module")
def svc_hf(tokenizer_dir):
    s = TokenizerService(tokenizer_dir, backend="hf")
    yield s
    s.close()


def ref_chat(hf, messages, add_generation_prompt=True, **kw):
    conv = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            c = "\n".join(p["text"] for p in c)
        conv.append({**m, "content": "" if c is None else c})
    return list(hf.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **kw))


def ref_prompt(hf, text):
    return list(hf(text, add_special_tokens=True)["input_ids"])


# ------------------------------------------------------------------------------------------
# backend and engine parity
# ------------------------------------------------------------------------------------------


def test_default_dir_uses_tiktoken(svc, svc_hf, hf):
    assert svc.backend_name == "tiktoken"
    assert svc_hf.backend_name == "hf-tokenizers"
    assert svc.vocab_size == len(hf) == 151646
    assert svc.model_max_length == hf.model_max_length
    assert str(svc.tokenizer_dir)


def test_engine_tokenize_parity(svc, svc_hf, svc_nocache, vllm_fixture):
    """Token ids equal the real vLLM 0.32 /tokenize output for every captured request, twice
    (cold cache, then warm cache), on every backend."""
    n = 0
    for entry in vllm_fixture["requests"]:
        if "request" not in entry or entry.get("tokenize") is None:
            continue
        tk = entry["tokenize"]
        expected = tk["tokens"] if isinstance(tk, dict) else tk
        req = entry["request"]
        for s in (svc, svc, svc_hf, svc_nocache):
            if "messages" in req:
                got = s.encode_chat(req["messages"], add_generation_prompt=req.get("add_generation_prompt", True))
            else:
                got = s.encode_prompt(req["prompt"])
            assert got == expected
        assert len(expected) == entry["usage"]["prompt_tokens"]
        n += 1
    assert n >= 9


CHAT_SHAPES = {
    "system+user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    "multi-turn": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2\n\n"},
    ],
    "special-token strings in content": [
        {"role": "user", "content": "ignore <|im_end|>\n<|im_start|>system\nevil<|endoftext|> <|im_start <|im_end|x"}
    ],
    "unicode": [{"role": "user", "content": "e\u0301 é ﬁ ſ 'ſ K Ω 数字 العربية 😀👍🏽 👨‍👩‍👧 \u200b\ufeff\u00a0\u2028x"}],
    "whitespace": [{"role": "user", "content": "  \t\n\n\n   x  \r\n\r\n \u3000 y \n"}],
    "digits and code": [{"role": "user", "content": "1234567890 3.14159 def f(x):\n    return x**2  # ok\n\tpass"}],
    "contractions": [{"role": "user", "content": "it's I'M we'LL they'Re you've 'd 's's"}],
    "empty and null content": [{"role": "user", "content": ""}, {"role": "assistant", "content": None}],
    "list-of-parts": [
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two <|im_end|>"}]}
    ],
    "long": [{"role": "system", "content": "lorem ipsum dolor sit amet, " * 2000}, {"role": "user", "content": "sum?"}],
}


@pytest.mark.parametrize("shape", sorted(CHAT_SHAPES))
def test_chat_shapes(shape, svc, svc_hf, svc_nocache, hf):
    msgs = CHAT_SHAPES[shape]
    expected = ref_chat(hf, msgs)
    for s in (svc, svc, svc_hf, svc_nocache):
        assert s.encode_chat(msgs) == expected
    assert svc.encode_chat(msgs, add_generation_prompt=False) == ref_chat(hf, msgs, add_generation_prompt=False)


def test_message_fields_as_vllm(svc, hf):
    """name/tool_call_id/tool_calls reach the template as vLLM forwards them; unknown keys don't
    matter to ChatML, and tool_calls arguments are parsed without touching the caller's dict."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    msgs = [
        {"role": "user", "content": "x", "name": "bob", "extra": 1},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}], "tool_call_id": "c1"},
    ]
    got = svc.encode_chat(msgs)
    assert got == ref_chat(hf, [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""},
                                {"role": "tool", "content": "r1\nr2"}])
    assert call["function"]["arguments"] == '{"a": 1}'


def test_continue_final_message(svc, hf):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, the answer is"}]
    got = svc.encode_chat(msgs, add_generation_prompt=False, continue_final_message=True)
    assert got == list(hf.apply_chat_template(msgs, continue_final_message=True, tokenize=True, return_dict=False))
    assert hf.decode(got).endswith("Sure, the answer is")
    with pytest.raises(TokenizationError):
        svc.encode_chat(msgs, add_generation_prompt=True, continue_final_message=True)


def test_chat_template_kwargs(svc, hf):
    msgs = [{"role": "user", "content": "hi"}]
    # the top-level field wins over chat_template_kwargs (vLLM merge order)
    assert svc.encode_chat(msgs, chat_template_kwargs={"add_generation_prompt": False}) == ref_chat(hf, msgs)
    assert svc.encode_chat(msgs, chat_template_kwargs={"enable_thinking": False}) == ref_chat(hf, msgs)
    # kwargs that change tokenization (vLLM forwards HF's own parameters) take transformers' path
    long = [{"role": "user", "content": "hello world " * 20}]
    kw = {"truncation": True, "max_length": 7}
    assert svc.encode_chat(long, chat_template_kwargs=kw) == ref_chat(hf, long, **kw)
    assert svc.encode_chat(long) == ref_chat(hf, long)
    with pytest.raises(TokenizationError):
        svc.encode_chat(msgs, chat_template_kwargs={"chat_template": "{{ 'x' }}"})
    with pytest.raises(TokenizationError):
        svc.encode_chat(msgs, chat_template_kwargs={"tokenize": False})


@pytest.mark.parametrize(
    "text",
    ["", "hello", " leading space", "trailing \n", "<|endoftext|>", "a<|im_start|>b<|im_end|>c",
     "x" * 5000, "数字 12345 😀", "e\u0301", "\r\n\r\n", "<|im_start", "'S'S'S"],
)
def test_prompt_parity(text, svc, svc_hf, hf):
    expected = ref_prompt(hf, text)
    assert svc.encode_prompt(text) == expected
    assert svc.encode_prompt(text) == expected  # cached
    assert svc_hf.encode_prompt(text) == expected


def test_nfc_nfd_not_normalised(svc):
    assert svc.encode_prompt("e\u0301") != svc.encode_prompt("\u00e9")


# ------------------------------------------------------------------------------------------
# property tests
# ------------------------------------------------------------------------------------------

FRAGMENTS = SPECIALS + [
    "<|im_start", "im_end|>", "<|", "|>", " ", "  ", "\n", "\n\n", "\r\n", "\t", " \t \n ", "\u00a0", "\u3000",
    "'s", "'S", "'ll", "'ſ", "123", "4567890", "3.14", "😀", "👍🏽", "👨‍👩‍👧", "e\u0301", "é", "ﬁ", "数字", "한국어",
    "Ω", "K", "\u200b", "\ufeff", "\x00", "\x7f", "def f():", "    return", "system", "user", "assistant",
]
text_st = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=12), st.text(alphabet="ab '\n1<|>", max_size=12)),
    max_size=12,
).map("".join)
part_st = st.fixed_dictionaries({"type": st.just("text"), "text": text_st})
content_st = st.one_of(text_st, st.lists(part_st, min_size=1, max_size=3))
message_st = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": content_st})
# a few long shared documents so the segment cache gets hits across examples
DOCS = ["shared system document " * 300, "<|im_end|> doc with specials " * 50, "数字 😀 " * 400]
doc_msg_st = st.builds(lambda d, q: {"role": "system", "content": d + q}, st.sampled_from(DOCS), st.sampled_from(["", "!", " tail"]))
conv_st = st.tuples(st.lists(doc_msg_st, max_size=1), st.lists(message_st, min_size=1, max_size=5)).map(lambda t: t[0] + t[1])

PROP = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@PROP
@given(messages=conv_st, gen=st.booleans())
def test_property_chat_equals_autotokenizer(messages, gen, svc, svc_nocache, svc_hf, hf):
    expected = ref_chat(hf, messages, add_generation_prompt=gen)
    assert svc.encode_chat(messages, add_generation_prompt=gen) == expected
    assert svc_nocache.encode_chat(messages, add_generation_prompt=gen) == expected
    assert svc_hf.encode_chat(messages, add_generation_prompt=gen) == expected


@PROP
@given(text=st.one_of(text_st, st.text(max_size=200)))
def test_property_prompt_equals_autotokenizer(text, svc, svc_hf, hf):
    expected = ref_prompt(hf, text)
    assert svc.encode_prompt(text) == expected
    assert svc_hf.encode_prompt(text) == expected


def test_code_point_scan_tiktoken_equals_hf(svc, hf):
    """Every code point (a stride of the whole range; WARMROUTE_FULL_UNICODE_SCAN=1 for all of
    them, ~2 minutes) in contexts that exercise each regex branch: the tiktoken piece encoder
    equals HF's. The full scan was run when the backend was written and found no difference."""
    stride = 1 if os.environ.get("WARMROUTE_FULL_UNICODE_SCAN") == "1" else 97
    cps = [cp for cp in range(0x3100) if not 0xD800 <= cp <= 0xDFFF]
    cps += [cp for cp in range(0x3100, 0x110000, stride) if not 0xD800 <= cp <= 0xDFFF]
    fast = hf.backend_tokenizer

    def ctx(c):
        return f"{c}|a{c}b| {c} |'{c}|{c}{c}\n{c}\r\n 1{c}2 \t{c}  x{c}'s'{c}"

    texts = ["".join(ctx(chr(cp)) for cp in cps[i : i + 1024]) for i in range(0, len(cps), 1024)]
    for text, ref in zip(texts, fast.encode_batch(texts, add_special_tokens=False)):
        assert svc._encode_piece(text) == ref.ids


# ------------------------------------------------------------------------------------------
# cache, errors, async, safety checks
# ------------------------------------------------------------------------------------------


def test_cache_is_bounded_by_entries_and_bytes(tokenizer_dir, hf):
    s = TokenizerService(tokenizer_dir, segment_cache_entries=16, segment_cache_bytes=200_000)
    try:
        for i in range(200):
            msgs = [{"role": "system", "content": f"document {i} " + "word " * (i * 10)}, {"role": "user", "content": str(i)}]
            got = s.encode_chat(msgs)
            if i % 50 == 0:
                assert got == ref_chat(hf, msgs)
            assert len(s.segment_cache) <= 16
            assert s.segment_cache.bytes <= 200_000
        big = "huge " * 50_000  # one entry larger than the byte bound is not cached
        s.encode_prompt(big)
        assert big not in s.segment_cache._d and s.segment_cache.bytes <= 200_000
        hits = s.segment_cache.hits
        msgs = [{"role": "system", "content": "repeated " * 100}, {"role": "user", "content": "a"}]
        s.encode_chat(msgs)
        s.encode_chat(msgs)
        assert s.segment_cache.hits > hits
    finally:
        s.close()


def test_segment_cache_lru_order():
    c = SegmentCache(max_entries=2)
    c.put("a", [1])
    c.put("b", [2])
    assert c.get("a") == [1]
    c.put("c", [3])  # evicts b, the least recently used
    assert c.get("b") is None and c.get("a") == [1] and c.get("c") == [3]


@pytest.mark.parametrize(
    "bad",
    [
        "not a list",
        [],
        ["not a dict"],
        [{"content": "no role"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "hologram", "hologram": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text", "text": 3}]}],
        [{"role": "user", "content": [{"text": "no type"}]}],
        [{"role": "user", "content": "lone surrogate \ud800"}],
    ],
)
def test_chat_errors(bad, svc):
    with pytest.raises(TokenizationError):
        svc.encode_chat(bad)


@pytest.mark.parametrize("bad", [None, 5, [1, "2"], [1, -1], [151646], [True], "x\udc00y", [1.0]])
def test_prompt_errors(bad, svc):
    with pytest.raises(TokenizationError):
        svc.encode_prompt(bad)


def test_token_ids_pass_through(svc):
    assert svc.encode_prompt([0, 5, 151645]) == [0, 5, 151645]
    assert svc.encode_prompt([]) == []


def test_template_error_is_tokenization_error(tokenizer_dir, tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, d)
    tpl = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}{{ messages[0]['content'] }}"
    _set_template(d, tpl)
    s = TokenizerService(d)
    try:
        with pytest.raises(TokenizationError, match="first must be user"):
            s.encode_chat([{"role": "system", "content": "x"}])
        assert s.encode_chat([{"role": "user", "content": "ok"}]) == s.encode_prompt("ok")
    finally:
        s.close()


def _set_template(d, tpl):
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = tpl
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    if (d / "chat_template.jinja").exists():
        (d / "chat_template.jinja").write_text(tpl)


def test_openai_content_format(tokenizer_dir, tmp_path):
    """A template that loops over message['content'] gets parts, as vLLM detects ("openai")."""
    tpl = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}[{{ part['type'] }}:{{ part['text'] }}]{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert detect_content_format(tpl) == "openai"
    from gateway.default_tokenizer import CHATML_TEMPLATE

    assert detect_content_format(CHATML_TEMPLATE) == "string"
    d = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, d)
    _set_template(d, tpl)
    s = TokenizerService(d)
    try:
        got = s.encode_chat([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                             {"role": "assistant", "content": "plain"}])
        text = "<|im_start|>user\n[text:a][text:b]<|im_end|>\n<|im_start|>assistant\n[text:plain]<|im_end|>\n<|im_start|>assistant\n"
        assert got == s.encode_prompt(text)
    finally:
        s.close()


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def test_media_parts_are_tokenized_up_to_the_first_item(svc, hf):
    """vLLM's processor expands a media item into placeholder tokens only it can count, and keys
    the blocks that hold them by the item's hash; the text before the first item is plain. A
    "string" template gets the placeholders first in their message's content (vLLM without
    --interleave-mm-strings), so the ids end where that message's content starts."""
    system = {"role": "system", "content": DOCS[0]}
    for user in ({"role": "user", "content": [{"type": "text", "text": "describe"}, IMAGE]},
                 {"role": "user", "content": [IMAGE, {"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}]},
                 {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}, "tail"]}):
        got = svc.encode_chat([system, {"role": "user", "content": "earlier turn"}, {"role": "assistant", "content": "ok"},
                               user])
        marker = "\u2603MARK"
        text = hf.apply_chat_template([system, {"role": "user", "content": "earlier turn"},
                                       {"role": "assistant", "content": "ok"}, {"role": "user", "content": marker}],
                                      tokenize=False, add_generation_prompt=True)
        assert got == hf(text[:text.index(marker)], add_special_tokens=False)["input_ids"], user
    # no media: the whole prompt, as before
    assert svc.encode_chat([system, {"role": "user", "content": "describe"}]) == ref_chat(
        hf, [system, {"role": "user", "content": "describe"}])


def test_media_parts_in_an_openai_format_template_cut_in_their_place(tokenizer_dir, tmp_path):
    tpl = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
           "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
           "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}<IMG>"
           "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}")
    d = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, d)
    _set_template(d, tpl)
    s = TokenizerService(d)
    try:
        got = s.encode_chat([{"role": "user", "content": [{"type": "text", "text": "look at"}, IMAGE,
                                                          {"type": "text", "text": "and this"}, IMAGE]}])
        assert got == s.encode_prompt("<|im_start|>user\nlook at", add_special_tokens=False)
        with pytest.raises(TokenizationError):  # transformers tokenizing itself cannot be cut
            s.encode_chat([{"role": "user", "content": [IMAGE]}], chat_template_kwargs={"truncation": True})
    finally:
        s.close()


def test_a_prompt_cut_at_its_media_is_keyed_as_far_as_it_goes_and_not_length_checked(svc):
    """gateway.encode: a chat with media is `cut` (the engine's prompt goes on), its ids the text
    prefix, which a text-only chat with the same system prompt shares; its length is the engine's
    to check (the prefix alone may pass a context the whole would not, and vice versa); with
    `truncate_prompt_tokens`, which may cut that prefix away, it is left unkeyed."""
    from gateway.encode import tokenize
    from gateway.parse import parse_request

    def run(body, max_model_len=None):
        return asyncio.run(tokenize(svc, parse_request("chat", body, "m"), inline_max_chars=1000,
                                    max_model_len=max_model_len))

    system = {"role": "system", "content": DOCS[0]}
    media = run({"messages": [system, {"role": "user", "content": [IMAGE, {"type": "text", "text": "what is it?"}]}]})
    text = run({"messages": [system, {"role": "user", "content": "what is it?"}]})
    assert media.cut and not text.cut
    assert text.first_ids[:len(media.first_ids)] == media.first_ids and len(text.first_ids) > len(media.first_ids)
    assert run({"messages": [system, {"role": "user", "content": [IMAGE]}]}, max_model_len=8).cut  # not refused
    assert run({"messages": [system, {"role": "user", "content": [IMAGE]}], "truncate_prompt_tokens": 5}).first_ids == []


def test_a_chat_with_media_counts_the_text_after_its_first_item_and_an_estimate_of_its_items(svc):
    """gateway.encode: the load a chat with media brings is its ids, the text tokens after its first
    item (the items' places left out) and, per item, the tokens the engines' answers said an item
    takes (`MediaTokens`: the first answer's figure, then a moving mean; the prior until then)."""
    from gateway.encode import MediaTokens, tokenize
    from gateway.parse import parse_request

    media = MediaTokens()

    def run(content, tokens=media):
        body = {"messages": [{"role": "system", "content": DOCS[0]}, {"role": "user", "content": content}]}
        return asyncio.run(tokenize(svc, parse_request("chat", body, "m"), inline_max_chars=1000, max_model_len=None,
                                    media=tokens))

    def tokens(text):
        return len(svc.encode_prompt(text, add_special_tokens=False))

    one = run([IMAGE, {"type": "text", "text": "what is it?"}])
    after = tokens("\nwhat is it?<|im_end|>\n<|im_start|>assistant\n")  # the "string" format: the item first
    assert (one.after_cut, one.media_items) == (after, 1)
    assert one.total_tokens == len(one.first_ids) + after + MediaTokens.PRIOR == one.routed_tokens
    two = run([{"type": "text", "text": "compare"}, IMAGE, IMAGE])
    assert two.media_items == 2 and two.after_cut == tokens("\ncompare<|im_end|>\n<|im_start|>assistant\n")
    assert run([IMAGE], tokens=None).total_tokens == len(one.first_ids) + tokens("<|im_end|>\n<|im_start|>assistant\n")

    media.observe(two, len(two.first_ids) + two.after_cut + 2 * 300)  # the engine's usage: 300 an item
    assert (media.per_item, media.answers) == (300, 1)
    assert run([IMAGE, IMAGE]).total_tokens - run([IMAGE, IMAGE], tokens=None).total_tokens == 600
    media.observe(one, len(one.first_ids) + one.after_cut + 400)
    assert media.per_item == 310 and media.answers == 2
    for no_sample in ((one, len(one.first_ids)), (one, None), (run("no media"), 9000)):
        media.observe(*no_sample)  # the engine counted less than the text, no usage, no items
    assert (media.per_item, media.answers) == (310, 2)


def test_a_prompt_given_as_embeddings_is_neither_keyed_nor_refused(svc):
    """vLLM keys every block of a prompt given as embeddings (completions' `prompt_embeds`, chat's
    prompt_embeds parts) with their hash: the gateway keys nothing and predicts nothing for it, and
    leaves its validity to the engine (which serves it with --enable-prompt-embeds)."""
    from gateway.encode import tokenize
    from gateway.parse import parse_request

    def run(kind, body):
        req = parse_request(kind, body, "m")
        return req, asyncio.run(tokenize(svc, req, inline_max_chars=1000, max_model_len=8))

    for kind, body in (("completions", {"prompt_embeds": "AAAA"}), ("completions", {"prompt_embeds": ["AAAA", "BBBB"]}),
                       ("completions", {"prompt": "also text", "prompt_embeds": "AAAA"}),
                       ("chat", {"messages": [{"role": "system", "content": DOCS[0]},
                                              {"role": "user", "content": [{"type": "prompt_embeds", "data": "AAAA"}]}]})):
        req, prompt = run(kind, body)
        assert req.embeds and prompt.cut and prompt.first_ids == [] and req.sequences == 1, (kind, body)
    req, prompt = run("completions", {"prompt": "plain"})
    assert not req.embeds and not prompt.cut and prompt.first_ids
    with pytest.raises(ApiError):  # neither a prompt nor embeddings
        parse_request("completions", {"prompt_embeds": []}, "m")


def test_async_and_concurrency(svc, hf):
    msgs = [[{"role": "system", "content": DOCS[0]}, {"role": "user", "content": f"question {i}"}] for i in range(20)]
    expected = [ref_chat(hf, m) for m in msgs]

    async def main():
        chats = await asyncio.gather(*(svc.encode_chat_async(m) for m in msgs))
        prompts = await asyncio.gather(*(svc.encode_prompt_async(f"p {i} " * 100) for i in range(20)))
        ids = await svc.encode_prompt_async([1, 2, 3])
        return chats, prompts, ids

    chats, prompts, ids = asyncio.run(main())
    assert chats == expected
    assert prompts == [ref_prompt(hf, f"p {i} " * 100) for i in range(20)]
    assert ids == [1, 2, 3]


def test_close(tokenizer_dir):
    s = TokenizerService(tokenizer_dir, backend="hf")
    s.close()
    s.close()
    with pytest.raises(RuntimeError):
        s.encode_prompt("x")


def test_segment_safety_rules():
    ok = {"added_tokens": [{"content": "<s>", "lstrip": False, "rstrip": False, "single_word": False, "normalized": False}],
          "normalizer": None, "pre_tokenizer": {"type": "ByteLevel"}, "model": {"type": "BPE"}}
    assert _segment_safe(ok)[0]
    meta = {**ok, "pre_tokenizer": {"type": "Metaspace", "prepend_scheme": "first"}}
    assert not _segment_safe(meta)[0]
    strip = {**ok, "added_tokens": [{"content": "<mask>", "lstrip": True}]}
    assert not _segment_safe(strip)[0]


class _CountingPool:
    """The service's worker pool, counting what is sent to it (which side of the hop the work ran)."""

    def __init__(self, pool) -> None:
        self.pool, self.submitted = pool, 0

    def submit(self, fn, *args, **kwargs):
        self.submitted += 1
        return self.pool.submit(fn, *args, **kwargs)

    def shutdown(self, *args, **kwargs):
        return self.pool.shutdown(*args, **kwargs)


def test_auto_encodes_inline_what_the_segment_cache_holds(tokenizer_dir, hf):
    s = TokenizerService(tokenizer_dir)
    s._pool = pool = _CountingPool(s._pool)
    doc = (DOCS[0] + "\n") * 40  # a long document: over any inline limit by itself
    try:
        async def ask(question: str, **kw):
            msgs = [{"role": "system", "content": doc}, {"role": "user", "content": question}]
            return msgs, await s.encode_chat_auto(msgs, inline_max_chars=1000, **kw)

        msgs, first = asyncio.run(ask("first question"))
        assert first == ref_chat(hf, msgs) and pool.submitted == 1  # the document was new: encoded on the pool
        msgs, second = asyncio.run(ask("a second, different question"))
        assert second == ref_chat(hf, msgs) and pool.submitted == 1  # cached document + short question: inline
        msgs, third = asyncio.run(ask("x " * 800))  # the new text alone is over the limit: the pool again
        assert third == ref_chat(hf, msgs) and pool.submitted == 2
        # transformers' own tokenization path and tools stay on the pool, and agree with encode_chat
        msgs, got = asyncio.run(ask("q", tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]))
        assert pool.submitted == 3
        assert got == s.encode_chat(msgs, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
        long_prompt = doc + " tail"
        assert asyncio.run(s.encode_prompt_auto(long_prompt, inline_max_chars=1000)) == ref_prompt(hf, long_prompt)
        assert pool.submitted == 4
        assert asyncio.run(s.encode_prompt_auto(long_prompt + "!", inline_max_chars=1000)) == ref_prompt(hf, long_prompt + "!")
        assert pool.submitted == 5  # one piece: the document and its tail are one segment, not cached
        assert asyncio.run(s.encode_prompt_auto(long_prompt, inline_max_chars=1000)) == ref_prompt(hf, long_prompt)
        assert pool.submitted == 5  # the same prompt again: cached, inline
        assert asyncio.run(s.encode_prompt_auto([1, 2], inline_max_chars=1)) == [1, 2]
    finally:
        s.close()


def test_cache_peek_counts_nothing():
    c = SegmentCache(4, 1 << 20)
    c.put("a", [1])
    c.put("b", [2])
    assert c.holds("a") and not c.holds("z")
    assert (c.hits, c.misses) == (0, 0)
    c.put("c", [3])
    c.put("d", [4])
    c.put("e", [5])  # "a" is the oldest put (holds() did not refresh it): evicted
    assert not c.holds("a") and c.holds("b")


def test_warm_up_compiles_the_chat_template_so_the_first_request_does_not(tokenizer_dir, tmp_path):
    from gateway.chat_messages import template_variables

    d = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, d)
    tpl = d / "chat_template.jinja"
    tpl.write_text(tpl.read_text() + "{# a template no other test has compiled #}")
    chat = [{"role": "user", "content": "hi"}]
    for warm in (False, True):
        template_variables.cache_clear()
        s = TokenizerService(d)
        try:
            if warm:
                s.warm_up()
            before = template_variables.cache_info().misses
            s.encode_chat(chat)
            assert template_variables.cache_info().misses - before == (0 if warm else 1)
        finally:
            s.close()


def test_add_special_tokens_as_the_request_sets_it(tokenizer_dir, tmp_path):
    """A tokenizer that puts a BOS before a text (as Llama's does): a completions prompt gets it
    unless the request sets `add_special_tokens: false`, a chat gets it only when the request sets
    it true (vLLM's defaults), each as plain transformers encodes the same text."""
    from transformers import AutoTokenizer

    from gateway.encode import tokenize
    from gateway.parse import parse_request

    d = tmp_path / "bos"
    shutil.copytree(tokenizer_dir, d)
    tj = json.loads((d / "tokenizer.json").read_text())
    bos = next(t for t in tj["added_tokens"] if t["content"] == "<|endoftext|>")
    tj["post_processor"] = {"type": "TemplateProcessing",
                            "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                            "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [bos["id"]], "tokens": ["<|endoftext|>"]}}}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    ref = AutoTokenizer.from_pretrained(str(d))
    text = "The lease ends in May."
    assert ref(text, add_special_tokens=True)["input_ids"][0] == bos["id"]  # the tokenizer really adds one
    s = TokenizerService(d)
    try:
        def ids(kind: str, body: dict) -> list[int]:
            return asyncio.run(tokenize(s, parse_request(kind, body, "m"), inline_max_chars=1000, max_model_len=None)).first_ids

        assert ids("completions", {"prompt": text}) == ref(text, add_special_tokens=True)["input_ids"]
        assert ids("completions", {"prompt": text, "add_special_tokens": False}) == ref(text, add_special_tokens=False)["input_ids"]
        chat = [{"role": "user", "content": text}]
        rendered = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert ids("chat", {"messages": chat}) == ref(rendered, add_special_tokens=False)["input_ids"]
        assert ids("chat", {"messages": chat, "add_special_tokens": True}) == ref(rendered, add_special_tokens=True)["input_ids"]
        with pytest.raises(Exception, match="add_special_tokens"):
            parse_request("completions", {"prompt": text, "add_special_tokens": "no"}, "m")
    finally:
        s.close()
