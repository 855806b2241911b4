"""Parse and validate an OpenAI request (pure: bytes and dicts in, records or ApiError out).

Rule: everything the gateway can refuse before it tokenizes is refused here, with OpenAI's error
shape and the offending field in `param`: a body that is not a JSON object (400 invalid_json /
invalid_encoding), a missing or non-string `model` (400), a model the gateway does not serve
(404 model_not_found; 503 while it does not know its model yet), wrong types of `stream`,
`stream_options`, `max_tokens`, `n`, `add_special_tokens`, `truncate_prompt_tokens`,
`truncation_side`, `messages`, `prompt` and the chat-template options (400), and, after
tokenization, a prompt over the model's context (400 context_length_exceeded, vLLM's text). It
also reads what changes the tokens the engine computes or the cached tokens it reports: those
fields, whether the request asks for its prompt's logprobs (then the engine reads no cached
block), and whether it gives its prompt as embeddings (`prompt_embeds`: then nothing is keyed).
Fields the gateway does not read pass through to the engine untouched (it is the judge of them).
"""
from __future__ import annotations

from typing import Collection

import msgspec

from gateway.chat_messages import has_part, template_kwargs
from gateway.context import CHAT, COMPLETIONS, RESPONSES, ParsedRequest
from gateway.errors import ApiError
from gateway.responses_api import parse_responses

__all__ = ["parse_body", "check_model", "parse_request", "check_context_length", "chat_chars"]

_decode = msgspec.json.decode


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object."""
    if not raw:
        raise ApiError(400, "empty request body: expected a JSON object", code="invalid_json")
    try:
        payload = _decode(raw)
    except msgspec.DecodeError as exc:
        text = str(exc)
        if "UTF-8" in text:
            raise ApiError(400, "request body is not valid UTF-8", code="invalid_encoding") from None
        raise ApiError(400, f"malformed JSON: {text}", code="invalid_json") from None
    except RecursionError:  # msgspec raises it past Python's recursion limit (~1000 levels)
        raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return payload


def check_model(payload: dict, served: Collection[str], known: bool) -> str:
    """The requested model, if this gateway serves it. `known`: the gateway knows its model."""
    model = payload.get("model")
    if model is None:
        raise ApiError(400, "missing required field 'model'", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model", code="invalid_type")
    if not known:
        raise ApiError(503, "the gateway does not know its model yet (no replica answered /v1/models)",
                       code="not_ready")
    if model not in served:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
    return model


def parse_request(kind: str, payload: dict, model: str, *, stored_responses: bool = False) -> ParsedRequest:
    """Validate the fields the gateway reads; see the module rule. `stored_responses`: the engines
    store Responses (gateway.responses_api)."""
    if kind == RESPONSES:
        return parse_responses(payload, model, stored=stored_responses)
    stream = payload.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream", code="invalid_type")
    so = payload.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options", code="invalid_type")
    common = {"kind": kind, "model": model, "stream": bool(stream), "n": _choices(payload),
              "reads_cache": not _prompt_logprobs(kind, payload),
              "add_special_tokens": _flag(payload, "add_special_tokens", kind == COMPLETIONS),
              **_truncation(payload),
              "client_wants_usage": bool(so and so.get("include_usage")), "max_tokens": _max_tokens(kind, payload)}
    if kind == CHAT:
        return _parse_chat(payload, common)
    if kind == COMPLETIONS:
        embeds = payload.get("prompt_embeds") not in (None, "", [])
        prompts = [] if embeds and payload.get("prompt") is None else _parse_prompts(payload)
        return ParsedRequest(prompts=prompts, embeds=embeds, **common)
    raise ValueError(f"unknown request kind {kind!r}")


def _prompt_logprobs(kind: str, payload: dict) -> bool:
    """The request asks for its prompt's logprobs, so vLLM 0.32 reads nothing from its prefix cache
    (SamplingParams.skip_reading_prefix_cache): `prompt_logprobs` set, or `echo` with the logprobs
    vLLM then takes for the prompt (chat: `top_logprobs`, never None there; completions: `logprobs`)."""
    if payload.get("prompt_logprobs") is not None:
        return True
    if not payload.get("echo"):
        return False
    return kind == CHAT or payload.get("logprobs") is not None


def _truncation(payload: dict) -> dict:
    """vLLM's `truncate_prompt_tokens` (an integer >= -1) and `truncation_side` ("left", "right")."""
    n, side = payload.get("truncate_prompt_tokens"), payload.get("truncation_side")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < -1):
        raise ApiError(400, "'truncate_prompt_tokens' must be an integer >= -1", param="truncate_prompt_tokens",
                       code="invalid_type")
    if side not in (None, "left", "right"):
        raise ApiError(400, "'truncation_side' must be 'left' or 'right'", param="truncation_side", code="invalid_value")
    return {"truncate": n, "truncation_side": side}


def _flag(payload: dict, field: str, default: bool) -> bool:
    v = payload.get(field)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"'{field}' must be a boolean", param=field, code="invalid_type")
    return v


def _choices(payload: dict) -> int:
    n = payload.get("n")
    return 1 if n is None else _positive_int(n, "n")


def _max_tokens(kind: str, payload: dict) -> int:
    max_tokens = payload.get("max_completion_tokens") if kind == CHAT else None
    if max_tokens is None:
        max_tokens = payload.get("max_tokens")
    return 0 if max_tokens is None else _positive_int(max_tokens, "max_tokens")


def _positive_int(v: object, param: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{param}' must be an integer", param=param, code="invalid_type")
    if v < 1:
        raise ApiError(400, f"'{param}' must be at least 1", param=param, code="invalid_value")
    return v


def _parse_chat(payload: dict, common: dict) -> ParsedRequest:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages", code="invalid_type")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'",
                           param="messages", code="invalid_type")
    agp = payload.get("add_generation_prompt", True)
    cfm = payload.get("continue_final_message", False)
    if not isinstance(agp, bool) or not isinstance(cfm, bool):
        raise ApiError(400, "'add_generation_prompt'/'continue_final_message' must be booleans",
                       param="add_generation_prompt", code="invalid_type")
    ctk = payload.get("chat_template_kwargs")
    if ctk is not None and not isinstance(ctk, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs",
                       code="invalid_type")
    tools = payload.get("tools")
    if payload.get("tool_choice") == "none" and not (ctk or {}).get("include_tools_with_tool_choice_none"):
        tools = None  # vLLM drops tools from the template when tool_choice is "none" (its default)
    return ParsedRequest(messages=messages, add_generation_prompt=agp, continue_final_message=cfm,
                         embeds=has_part(messages, ("prompt_embeds",)),
                         chat_template_kwargs=template_kwargs(ctk, documents=payload.get("documents"),
                                                              reasoning_effort=payload.get("reasoning_effort")),
                         tools=tools, **common)


def _parse_prompts(payload: dict) -> list:
    prompt = payload.get("prompt")
    if prompt is None:
        raise ApiError(400, "missing required field 'prompt'", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return list(prompt)
    raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of those",
                   param="prompt", code="invalid_type")


_PROMPT_FIELD = {CHAT: "messages", COMPLETIONS: "prompt", RESPONSES: "input"}  # where a kind's prompt is


def check_context_length(kind: str, n_tokens: int, max_tokens: int, max_model_len: int | None) -> None:
    """Refuse an empty prompt, and one that (with max_tokens) does not fit the model's context."""
    where = _PROMPT_FIELD[kind]
    if n_tokens == 0:
        raise ApiError(400, "the prompt is empty", param=where, code="invalid_prompt")
    if max_model_len is None:
        return
    if n_tokens >= max_model_len or (max_tokens and n_tokens + max_tokens > max_model_len):
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                            f"{n_tokens + max_tokens} tokens ({n_tokens} in the {where}, "
                            f"{max_tokens} in the completion). Please reduce the length of the {where} "
                            f"or completion.", param=where, code="context_length_exceeded")


def chat_chars(messages: list) -> int:
    """A cheap size of a chat's text (string contents and text parts; 64 per other part)."""
    n = 0
    for m in messages:
        c = m.get("content")
        if isinstance(c, str):
            n += len(c)
        elif isinstance(c, list):
            for part in c:
                t = part.get("text") if isinstance(part, dict) else None
                n += len(t) if isinstance(t, str) else 64
        else:
            n += 64
    return n
