"""vLLM's OpenAI request rules, for the simulated replica: a body's fields checked with vLLM's
messages (`BadRequest`: status, type and param as vLLM answers), the prompt tokenized as the
engine does (chat template or completion, special-token defaults; long texts in a worker thread,
off the event loop), and the request the engine takes (`ParsedRequest`). No HTTP here: the server
(loadtests/sim/server.py) turns a `BadRequest` into vLLM's error response."""
from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from loadtests.sim.tokenize import SimTokenizer

__all__ = ["BadRequest", "ParsedRequest", "RequestReader", "check_type", "validate_cache_salt", "chat_messages",
           "read_json_body"]

INLINE_TOKENIZE_CHARS = 16384  # longer texts are tokenized in a worker thread, off the event loop


class BadRequest(Exception):
    """A client error, reported as vLLM does: HTTP 400 with an OpenAI-style body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.err_type = message, param, status, err_type


@dataclass
class ParsedRequest:
    """A generation request as the engine takes it."""

    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    cache_salt: str | None
    report_full: bool
    priority: int = 0
    n: int = 1  # choices: vLLM runs n child requests on the prompt (loadtests/sim/choices.py)
    more_prompts: list | None = None  # a completions batch's other prompts (token ids), each as many more requests


def check_type(body: dict, key: str, types: tuple, what: str) -> Any:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in types:
        raise BadRequest(f"'{key}' must be {what}, got {type(v).__name__}", key)
    if not isinstance(v, types):
        raise BadRequest(f"'{key}' must be {what}, got {type(v).__name__}", key)
    return v


def validate_cache_salt(salt: Any) -> str | None:
    """vLLM's rule: a non-empty string of at most 128 characters without @ / \\ or NUL."""
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise BadRequest("Parameter 'cache_salt' must be a string.", "cache_salt")
    if not salt:
        raise BadRequest("Parameter 'cache_salt' must be a non-empty string.", "cache_salt")
    if len(salt) > 128:
        raise BadRequest("Parameter 'cache_salt' must be at most 128 characters.", "cache_salt")
    if any(c in salt for c in "@/\\\x00"):
        raise BadRequest("Parameter 'cache_salt' must not contain '@', '/', '\\' or NUL characters.", "cache_salt")
    return salt


_TEXT_PARTS = ("text", "input_text", "output_text")  # part types vLLM reads as text
# Part types a multi-modal vLLM hands to its processor (vLLM's MM_PARSER_MAP; SimConfig.multimodal).
_MEDIA_PARTS = frozenset({"image_url", "input_image", "image_embeds", "audio_url", "input_audio", "audio_embeds",
                          "video_url", "video_embeds"})


def _placeholder(part: dict, pad: int = 0) -> str:
    """A media item's placeholder text, naming a digest of the item: the blocks that hold it are
    keyed by the item, as vLLM's multi-modal hash keys them; those before it are plain text.
    `pad`: as many tokens more (" pad"), as a model's processor expands an image into hundreds."""
    digest = hashlib.sha256(json.dumps(part, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"<{part['type']} {digest}>" + " pad" * pad


def chat_messages(body: dict, media: bool = False, media_tokens: int = 0) -> list[dict]:
    """The messages as the chat template gets them; `media`: image, audio and video parts are
    served (a multi-modal model), each as its placeholder first in its message's content, where
    vLLM puts them (without --interleave-mm-strings), else refused."""
    msgs = body.get("messages")
    if msgs is None:
        raise BadRequest("Field required: 'messages'", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: text parts joined as vLLM's "string" format does
            texts, items = [], []
            for part in content:
                if media and isinstance(part, dict) and part.get("type") in _MEDIA_PARTS:
                    items.append(_placeholder(part, media_tokens))
                    continue
                if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
                texts.append(part["text"])
            m = {**m, "content": "\n".join(items + texts)}
        elif content is not None and not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts", "messages")
        elif content is None:
            m = {**m, "content": ""}
        out.append(m)
    return out


def read_json_body(raw: bytes, model: str, adapters: tuple[str, ...] = ()) -> dict:
    """A request body: a JSON object naming no model but `model` or one of its LoRA `adapters`
    (vLLM's 404 for another)."""
    try:
        body = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"Invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object")
    name = body.get("model")
    if name is not None and name != model and name not in adapters:
        raise BadRequest(f"The model `{name}` does not exist.", "model", 404, "NotFoundError")
    return body


class RequestReader:
    """Bodies to token ids and engine requests, with one replica's tokenizer and limits."""

    def __init__(self, tokenizer: SimTokenizer, *, max_model_len: int, default_max_tokens: int,
                 scheduling_policy: str, media: bool = False, media_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.media = media  # a multi-modal model (chat_messages)
        self.media_tokens = media_tokens  # its placeholder's tokens past the digest (chat_messages)
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.scheduling_policy = scheduling_policy

    async def _encode(self, fn, *args) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def prompt_ids(self, body: dict, chat: bool, add_special_default: bool) -> list[int]:
        tok = self.tokenizer
        if chat:
            msgs = chat_messages(body, self.media, self.media_tokens)
            agp = check_type(body, "add_generation_prompt", (bool,), "a boolean")
            ast = check_type(body, "add_special_tokens", (bool,), "a boolean")
            ctk = check_type(body, "chat_template_kwargs", (dict,), "an object")
            args = (msgs, True if agp is None else agp, add_special_default if ast is None else ast, ctk)
            size = sum(len(m.get("content") or "") for m in msgs)
            try:
                if size > INLINE_TOKENIZE_CHARS:
                    return await self._encode(tok.encode_chat, *args)
                return tok.encode_chat(*args)
            except Exception as e:  # template errors are the client's
                raise BadRequest(f"Failed to apply the chat template: {e}", "messages") from None
        if "prompt" not in body or body["prompt"] is None:
            raise BadRequest("Field required: 'prompt'", "prompt")
        prompt = body["prompt"]
        ast = check_type(body, "add_special_tokens", (bool,), "a boolean")
        add_special = add_special_default if ast is None else ast
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if len(prompt) > INLINE_TOKENIZE_CHARS:
                return await self._encode(tok.encode, prompt, add_special)
            return tok.encode(prompt, add_special)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise BadRequest("'prompt' must be a string, a list of token ids, or a list of those", "prompt")

    async def parse(self, body: dict, chat: bool) -> ParsedRequest:
        for key, types, what in (
            ("stream", (bool,), "a boolean"),
            ("ignore_eos", (bool,), "a boolean"),
            ("temperature", (int, float), "a number"),
            ("top_p", (int, float), "a number"),
            ("top_k", (int,), "an integer"),
            ("seed", (int,), "an integer"),
            ("n", (int,), "an integer"),
            ("stop", (str, list), "a string or a list of strings"),
            ("stream_options", (dict,), "an object"),
            ("vllm_xargs", (dict,), "an object"),
            ("user", (str,), "a string"),
        ):
            check_type(body, key, types, what)
        n = body.get("n")
        if n is not None and n < 1:
            raise BadRequest(f"n must be at least 1, got {n}.", "n")
        max_tokens = check_type(body, "max_tokens", (int,), "an integer")
        if chat:
            mct = check_type(body, "max_completion_tokens", (int,), "an integer")
            if mct is not None:
                max_tokens = mct
        if max_tokens is not None and max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
        salt = validate_cache_salt(body.get("cache_salt"))
        priority = check_type(body, "priority", (int,), "an integer") or 0
        if priority and self.scheduling_policy != "priority":  # as vLLM refuses it
            raise BadRequest(f"Got priority {priority} but Priority scheduling is not enabled.", "priority")
        stream = bool(body.get("stream") or False)
        so = body.get("stream_options") or {}
        if so and not stream:
            raise BadRequest("Stream options can only be defined when `stream=True`.", "stream_options")
        xargs = body.get("vllm_xargs") or {}
        prompt = body.get("prompt")
        if not chat and isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(x, (str, list)) for x in prompt):
            batch = [await self.prompt_ids({**body, "prompt": x}, chat, add_special_default=True) for x in prompt]
        else:
            batch = [await self.prompt_ids(body, chat, add_special_default=not chat)]
        ids = max(batch, key=len)  # the context check's
        n_prompt = len(ids)
        if n_prompt == 0:
            raise BadRequest("The prompt cannot be empty.", "prompt")
        mml = self.max_model_len
        if max_tokens is None:
            max_tokens = max(1, min(self.default_max_tokens, mml - n_prompt))
        if n_prompt + max_tokens > mml or n_prompt >= mml:
            where = "messages" if chat else "prompt"
            raise BadRequest(
                f"This model's maximum context length is {mml} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the {where}, {max_tokens} in the completion). "
                f"Please reduce the length of the {where} or completion.",
                "max_tokens" if n_prompt < mml else where,
            )
        return ParsedRequest(
            batch[0], max_tokens, stream, bool(so.get("include_usage")), bool(so.get("continuous_usage_stats")), salt,
            xargs.get("kv_cache_report_mode") == "full", priority, n or 1, batch[1:] or None,
        )
