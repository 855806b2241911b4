"""Tokenize stage: a parsed request's prompt as the engine will tokenize it (gateway.tokenization).

Rule: chat applies the model's chat template with the request's template options; completions
encode each prompt with special tokens (a token-id prompt is taken as is); `add_special_tokens`
as the request sets it, else vLLM's default (completions true, chat false: the template has them);
`truncate_prompt_tokens` cuts each prompt as vLLM does (`truncated`) before the context check; a
completions batch keeps its last prompt too (its usage reports that one). Short inputs tokenize
inline; for long ones the tokenizer encodes inline what its segment cache holds plus at most
`inline_max_chars` of new text, and sends more than that to its worker threads: a thread hop costs
more than a short encoding (or a cached document), and with a busy loop the worker waits for the
GIL up to a switch interval. A completions batch of several prompts goes to the workers. A
tokenizer refusal (unknown token id, invalid text) is the client's error (400 invalid_prompt); the
context length check (gateway.parse) runs on the result. A chat with media parts (images, audio,
video) is tokenized up to its first item (`Prompt.cut`: the rest is the engine's processor's), so
the engine checks its length, and with `truncate_prompt_tokens` (which may cut that text away) it
is left unkeyed, as is a prompt given as embeddings (`prompt_embeds`), every block of which the
engine keys with their hash. Such a chat's tokens, for the load it brings (`Prompt.total_tokens`),
are its ids, the text tokens after its first item and an estimate of the items' own tokens
(`MediaTokens`: the engine's processor decides them, by an image's size and the model's patches,
so the gateway learns them from the engines' answers instead of computing them).
"""
from __future__ import annotations

import time

from gateway.chat_messages import has_media
from gateway.context import CHAT, RESPONSES, ParsedRequest, Prompt
from gateway.errors import ApiError
from gateway.parse import chat_chars, check_context_length
from gateway.tokenization import TokenizationError, TokenizerService

__all__ = ["MediaTokens", "tokenize"]

_ERROR_PARAM = {CHAT: "messages", RESPONSES: "input"}  # the field a tokenization error names (else "prompt")


class MediaTokens:
    """Tokens one media item takes in the engine's prompt: a moving mean, over answered chats with
    media, of (the engine's prompt tokens - the gateway's text tokens) / items; the first answer
    replaces the prior. It weighs load only, never a prediction."""

    PRIOR = 576  # LLaVA-1.5's image (Qwen2-VL's 448 x 448 is 256, a megapixel ~1,300), until an answer says
    ALPHA = 0.1

    __slots__ = ("per_item", "answers")

    def __init__(self) -> None:
        self.per_item = float(self.PRIOR)
        self.answers = 0  # answers learned from

    def estimate(self, items: int) -> int:
        return round(items * self.per_item)

    def observe(self, prompt: Prompt | None, engine_prompt_tokens: int | None) -> bool:
        """Learn from one answer; False when it is no sample (no media, no usage)."""
        if prompt is None or not prompt.media_items or engine_prompt_tokens is None:
            return False
        per = (engine_prompt_tokens - len(prompt.first_ids) - prompt.after_cut) / prompt.media_items
        if per < 0:  # the engine counted another prompt (a template that drops text): no sample
            return False
        self.per_item = per if not self.answers else self.per_item + self.ALPHA * (per - self.per_item)
        self.answers += 1
        return True


async def tokenize(tok: TokenizerService, req: ParsedRequest, *, inline_max_chars: int,
                   max_model_len: int | None, media: MediaTokens | None = None) -> Prompt:
    """`media`: the items' tokens for a chat with media parts (None: none counted)."""
    t0 = time.perf_counter()
    if req.embeds:
        return Prompt([], 0, 0.0, cut=True)
    cut = req.messages is not None and has_media(req.messages)
    try:
        if cut and req.truncate is not None:
            prompts = [[]]
        elif cut:
            ids, after, items = await tok.encode_chat_cut(req.messages, inline_max_chars=inline_max_chars, **_chat_kw(req))
            total = len(ids) + after + (media.estimate(items) if media is not None else 0)
            return Prompt(ids, total, time.perf_counter() - t0, cut=True, after_cut=after, media_items=items)
        elif req.messages is not None:  # chat, and the Responses API rendered as one
            prompts = [await _chat(tok, req, inline_max_chars)]
        else:
            prompts = [await _prompt(tok, p, inline_max_chars, batch=len(req.prompts) > 1, specials=req.add_special_tokens)
                       for p in req.prompts]
    except TokenizationError as exc:
        raise ApiError(400, f"invalid input: {exc}", param=_ERROR_PARAM.get(req.kind, "prompt"),
                       code="invalid_prompt") from None
    if cut:
        return Prompt(prompts[0], len(prompts[0]), time.perf_counter() - t0, cut=True)
    if req.truncate is not None:
        texts = [True] if req.prompts is None else [isinstance(p, str) for p in req.prompts]
        prompts = [truncated(ids, req, max_model_len, tok.special_affixes, text=t) for ids, t in zip(prompts, texts)]
    n_tokens = max(len(p) for p in prompts)
    check_context_length(req.kind, n_tokens, req.max_tokens, max_model_len)
    last, shared = (prompts[-1], max(_common_prefix(p, prompts[-1]) for p in prompts[:-1])) if len(prompts) > 1 else (None, 0)
    return Prompt(prompts[0], sum(len(p) for p in prompts), time.perf_counter() - t0, last, shared)


def truncated(ids: list[int], req: ParsedRequest, max_model_len: int | None, affixes: tuple[int, int], *,
              text: bool) -> list[int]:
    """The prompt vLLM 0.32 keeps under `truncate_prompt_tokens` N (renderers/params.py): -1 is the
    context less one; "left" (a generative model's tokenizer's side) keeps the last N ids, "right"
    the first N. A text (not token ids) without an explicit `truncation_side` is truncated by the
    tokenizer itself, which keeps the special tokens it adds (`affixes`: a Llama BOS stays first)."""
    n = req.truncate
    if n is not None and n < 0:
        n = None if max_model_len is None else max_model_len - 1
    if n is None or n >= len(ids):
        return ids
    p, s = affixes if text and req.truncation_side is None and req.add_special_tokens else (0, 0)
    if p + s and n > p + s:
        own = ids[p:len(ids) - s]
        return ids[:p] + own[len(own) - (n - p - s):] + ids[len(ids) - s:]
    if n == 0:
        return []
    return ids[-n:] if (req.truncation_side or "left") == "left" else ids[:n]


def _common_prefix(a: list, b: list, step: int = 64) -> int:
    """Leading tokens `a` and `b` share (compared a slice at a time)."""
    n = min(len(a), len(b))
    i = 0
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _chat_kw(req: ParsedRequest) -> dict:
    return dict(add_generation_prompt=req.add_generation_prompt, chat_template_kwargs=req.chat_template_kwargs,
                tools=req.tools, continue_final_message=req.continue_final_message,
                add_special_tokens=req.add_special_tokens)


async def _chat(tok: TokenizerService, req: ParsedRequest, inline_max_chars: int) -> list[int]:
    kw = _chat_kw(req)
    if chat_chars(req.messages) <= inline_max_chars and not req.tools:
        return tok.encode_chat(req.messages, **kw)
    return await tok.encode_chat_auto(req.messages, inline_max_chars=inline_max_chars, **kw)


async def _prompt(tok: TokenizerService, prompt, inline_max_chars: int, *, batch: bool, specials: bool) -> list[int]:
    if not batch and (not isinstance(prompt, str) or len(prompt) <= inline_max_chars):
        return tok.encode_prompt(prompt, specials)
    if batch:
        return await tok.encode_prompt_async(prompt, specials)
    return await tok.encode_prompt_auto(prompt, inline_max_chars=inline_max_chars, add_special_tokens=specials)
