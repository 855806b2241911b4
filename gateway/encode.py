"""Tokenize stage: a parsed request's prompt as the engine will tokenize it (gateway.tokenization).

Rule: chat applies the model's chat template with the request's template options; completions
encode each prompt with special tokens (a token-id prompt is taken as is); `add_special_tokens`
as the request sets it, else vLLM's default (completions true, chat false: the template has them). Short inputs tokenize
inline; for long ones the tokenizer encodes inline what its segment cache holds plus at most
`inline_max_chars` of new text, and sends more than that to its worker threads: a thread hop costs
more than a short encoding (or a cached document), and with a busy loop the worker waits for the
GIL up to a switch interval. A completions batch of several prompts goes to the workers. A
tokenizer refusal (unknown token id, invalid text) is the client's error (400 invalid_prompt); the
context length check (gateway.parse) runs on the result.
"""
from __future__ import annotations

import time

from gateway.context import CHAT, RESPONSES, ParsedRequest, Prompt
from gateway.errors import ApiError
from gateway.parse import chat_chars, check_context_length
from gateway.tokenization import TokenizationError, TokenizerService

__all__ = ["tokenize"]

_ERROR_PARAM = {CHAT: "messages", RESPONSES: "input"}  # the field a tokenization error names (else "prompt")


async def tokenize(tok: TokenizerService, req: ParsedRequest, *, inline_max_chars: int,
                   max_model_len: int | None) -> Prompt:
    t0 = time.perf_counter()
    try:
        if req.messages is not None:  # chat, and the Responses API rendered as one
            prompts = [await _chat(tok, req, inline_max_chars)]
        else:
            prompts = [await _prompt(tok, p, inline_max_chars, batch=len(req.prompts) > 1, specials=req.add_special_tokens)
                       for p in req.prompts]
    except TokenizationError as exc:
        raise ApiError(400, f"invalid input: {exc}", param=_ERROR_PARAM.get(req.kind, "prompt"),
                       code="invalid_prompt") from None
    n_tokens = max(len(p) for p in prompts)
    check_context_length(req.kind, n_tokens, req.max_tokens, max_model_len)
    last, shared = (prompts[-1], max(_common_prefix(p, prompts[-1]) for p in prompts[:-1])) if len(prompts) > 1 else (None, 0)
    return Prompt(prompts[0], sum(len(p) for p in prompts), time.perf_counter() - t0, last, shared)


def _common_prefix(a: list, b: list, step: int = 64) -> int:
    """Leading tokens `a` and `b` share (compared a slice at a time)."""
    n = min(len(a), len(b))
    i = 0
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


async def _chat(tok: TokenizerService, req: ParsedRequest, inline_max_chars: int) -> list[int]:
    kw = dict(add_generation_prompt=req.add_generation_prompt, chat_template_kwargs=req.chat_template_kwargs,
              tools=req.tools, continue_final_message=req.continue_final_message, add_special_tokens=req.add_special_tokens)
    if chat_chars(req.messages) <= inline_max_chars and not req.tools:
        return tok.encode_chat(req.messages, **kw)
    return await tok.encode_chat_auto(req.messages, inline_max_chars=inline_max_chars, **kw)


async def _prompt(tok: TokenizerService, prompt, inline_max_chars: int, *, batch: bool, specials: bool) -> list[int]:
    if not batch and (not isinstance(prompt, str) or len(prompt) <= inline_max_chars):
        return tok.encode_prompt(prompt, specials)
    if batch:
        return await tok.encode_prompt_async(prompt, specials)
    return await tok.encode_prompt_auto(prompt, inline_max_chars=inline_max_chars, add_special_tokens=specials)
