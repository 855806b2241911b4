"""The OpenAI Responses API (`POST /v1/responses`) read as the engine reads it (pure).

vLLM renders a Responses request with the model's chat template, as a chat request: this module
turns the request into the chat messages, tools and template options vLLM 0.32 hands the template
(non-Harmony models; vllm/entrypoints/openai/responses/utils.py `construct_input_messages`,
`construct_tool_dicts` and `ResponsesRequest.build_chat_params`), so the gateway tokenizes,
keys and routes it like a chat request. Checked against what vLLM's own functions return
(tests/fixtures/vllm-0.32-responses-render.json) and, end to end, against real vLLM.

Rules (vLLM's):
- `instructions`, when not empty, is a system message first; a string `input` is one user message;
  a list's items become messages in order: a message item (any role) as it is, an assistant's
  text (a string, else its first part's `text`), `reasoning` (its first content text, else its
  first summary text; `encrypted_content` is refused) and `function_call` items merged into the
  assistant message before them where that one lacks the field (a `custom_tool_call`'s input as
  the JSON arguments `{"input": ...}`), `function_call_output` and `custom_tool_call_output` a
  `tool` message. Any other item type is refused (400), as vLLM refuses it.
- The last item, a message or reasoning with status `in_progress` or `incomplete`, is continued
  (`continue_final_message`) instead of a new generation prompt.
- Tools: `function` tools (`name`, `description`, `parameters`, and `strict` / `defer_loading`
  when set), each `namespace` tool's functions as `<namespace>__<name>`, a `custom` tool as a
  function of one string (`input`); other built-in tools
  are not shown to the model and are dropped; `tool_choice: "none"` keeps them (vLLM's default).
- `reasoning.effort` reaches the template as `reasoning_effort`, and as `enable_thinking`
  (effort not "none") unless the request's `chat_template_kwargs` set it.
- `truncation: "auto"` keeps the last tokens that fit the context (vLLM's truncate_prompt_tokens
  -1: gateway.encode.truncated); "disabled" (the default) refuses a prompt over it.
- Stored history (`previous_response_id`, served when the engines store responses: gateway.
  stored_responses): the new turn's instructions as the system message, then the stored history
  (every earlier turn's messages but the system ones, each followed by that turn's answer: the
  text of each `message` output part as one assistant message; reasoning and tool calls in an
  output are not carried), then the new input's messages, rendered on their own.
Refused here, where the gateway cannot route as the engine renders (400 `unsupported_parameter`):
`conversation` (vLLM keeps none), prompt templates (`prompt`), and, unless the gateway is told
the engines store responses, `previous_response_id` and `background`. The response's `usage` (`input_tokens`,
`input_tokens_details.cached_tokens`) is read by gateway.learn; the stream's events by
gateway.proxy.SseRelay.
"""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Sequence

from gateway.chat_messages import template_kwargs
from gateway.context import RESPONSES, ParsedRequest
from gateway.errors import ApiError

__all__ = ["parse_responses", "chat_messages", "template_tools", "continues_final", "turn_messages",
           "output_messages", "kept_messages", "with_history", "previous_id"]

_NOT_ROUTED = {
    "conversation": "vLLM keeps no conversations: send the history in `input`, or `previous_response_id`",
    "prompt": "prompt templates are rendered by the engine",
}
_NEEDS_STORE = {  # served only when the engines store responses (`responses.store`)
    "previous_response_id": "the conversation it names is held by one engine, and this gateway was not told the "
                            "engines store responses (`responses.store`): send the history in `input`",
    "background": "a background response is held by one engine, and this gateway was not told the engines store "
                  "responses (`responses.store`)",
}


def parse_responses(payload: dict, model: str, *, stored: bool = False) -> ParsedRequest:
    """The chat-shaped request vLLM renders for a Responses body (module rules); `stored`: the
    engines store responses, so `previous_response_id` and `background` are served. A follow-up's
    messages here are its own turn's: `with_history` puts the stored history in."""
    refused = _NOT_ROUTED if stored else {**_NOT_ROUTED, **_NEEDS_STORE}
    for field, why in refused.items():
        if payload.get(field) not in (None, False):
            raise ApiError(400, f"'{field}' is not supported through this gateway ({why})", param=field,
                           code="unsupported_parameter")
    prev = previous_id(payload)
    stream = payload.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream", code="invalid_type")
    max_tokens = payload.get("max_output_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ApiError(400, "'max_output_tokens' must be a positive integer", param="max_output_tokens",
                       code="invalid_type")
    instructions = payload.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "'instructions' must be a string", param="instructions", code="invalid_type")
    ctk = payload.get("chat_template_kwargs")
    if ctk is not None and not isinstance(ctk, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs",
                       code="invalid_type")
    truncation = payload.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise ApiError(400, "'truncation' must be 'auto' or 'disabled'", param="truncation", code="invalid_value")
    inp = payload.get("input")
    messages = chat_messages(instructions, inp)
    cont = continues_final(inp)
    return ParsedRequest(kind=RESPONSES, model=model, stream=bool(stream), client_wants_usage=True,
                         max_tokens=max_tokens or 0, messages=messages, add_generation_prompt=not cont,
                         continue_final_message=cont, chat_template_kwargs=_template_kwargs(payload, ctk),
                         tools=template_tools(payload.get("tools")), previous_response_id=prev,
                         background=bool(payload.get("background")),
                         truncate=-1 if truncation == "auto" else None)  # vLLM: the context less one


def previous_id(payload: dict) -> str | None:
    """The body's `previous_response_id` (400 unless a non-empty string, or absent)."""
    prev = payload.get("previous_response_id")
    if prev is not None and (not isinstance(prev, str) or not prev or len(prev) > 256):
        raise ApiError(400, "'previous_response_id' must be a response id", param="previous_response_id",
                       code="invalid_type")
    return prev


def chat_messages(instructions: str | None, inp: Any, history: Sequence[dict] = ()) -> list[dict]:
    """vLLM's `construct_input_messages`: the instructions, the stored `history` (module rules; its
    messages copied, never changed), then the input's messages, rendered on their own."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    messages += [dict(m) for m in history]
    return messages + turn_messages(inp)


def turn_messages(inp: Any) -> list[dict]:
    """The messages of one turn's `input` (vLLM's `construct_chat_messages_with_tool_call`)."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise ApiError(400, "'input' must be a string or a non-empty list of items", param="input", code="invalid_type")
    messages: list[dict] = []
    for i, item in enumerate(inp):
        if not isinstance(item, dict):
            raise ApiError(400, f"input[{i}] must be an object", param="input", code="invalid_type")
        msg = _message(item, messages[-1] if messages else None)
        if msg is not None:
            messages.append(msg)
    return messages


def with_history(req: ParsedRequest, payload: dict, history: Sequence[dict]) -> ParsedRequest:
    """A follow-up's request with its stored history put in (module rules)."""
    return replace(req, messages=chat_messages(payload.get("instructions"), payload.get("input"), history))


def kept_messages(messages: Sequence[dict]) -> list[dict]:
    """What a turn's messages carry into the next turn's history: all but the system ones."""
    return [m for m in messages if m.get("role") != "system"]


def output_messages(output: Any) -> list[dict]:
    """A stored answer as the next turn's history sees it: each text part of each `message` output
    item one assistant message (vLLM skips reasoning, tool calls and parts without text)."""
    out = []
    for item in output if isinstance(output, list) else ():
        if isinstance(item, dict) and item.get("type") == "message":
            for part in item.get("content") or ():
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    out.append({"role": "assistant", "content": part["text"]})
    return out


def _message(item: dict, prev: dict | None) -> dict | None:
    """One item's message, or None when it was merged into `prev` (the assistant message before it)."""
    helper = prev if prev is not None and prev.get("role") == "assistant" else None
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        name = _field(item, "name")
        if kind == "custom_tool_call":
            args = json.dumps({"input": item.get("input") or ""}, ensure_ascii=False)
        else:
            args = _field(item, "arguments")
            if item.get("namespace"):
                name = f"{item['namespace']}__{name}"
        call = {"id": _field(item, "call_id"), "function": {"name": name, "arguments": args}, "type": "function"}
        if helper is not None and isinstance(helper.get("tool_calls", []), list):
            helper.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise ApiError(400, "Encrypted content is not supported.", param="input", code="invalid_value")
        text = _first_text(item.get("content")) or _first_text(item.get("summary")) or ""
        if helper is not None and helper.get("reasoning") is None:
            helper["reasoning"] = text
            return None
        return {"role": "assistant", "reasoning": text}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else _first_text(content)
        if text is not None:
            if helper is not None and helper.get("content") is None:
                helper["content"] = text
                return None
            return {"role": "assistant", "content": text}
    if "role" in item:
        return dict(item)  # a copy: a later item may merge into it, and the client's body goes upstream as sent
    raise ApiError(400, f"Unsupported input item type: {kind}", param="input", code="invalid_value")


def _field(item: dict, name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ApiError(400, f"a {item.get('type')} item needs a string '{name}'", param="input", code="invalid_type")
    return value


def _first_text(parts: Any) -> str | None:
    if isinstance(parts, list) and parts and isinstance(parts[0], dict) and isinstance(parts[0].get("text"), str):
        return parts[0]["text"]
    return None


def continues_final(inp: Any) -> bool:
    """vLLM's `should_continue_final_message`: a partial last message or reasoning is continued."""
    if not isinstance(inp, list) or not inp or not isinstance(inp[-1], dict):
        return False
    last = inp[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in ("in_progress", "incomplete")


def template_tools(tools: Any) -> list | None:
    """The tools the template shows the model, in chat's shape (module rules); None: none."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", param="tools", code="invalid_type")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            out.append(_function(tool, tool.get("name")))
        elif kind == "namespace":
            out.extend(_function(t, f"{tool.get('name')}__{t.get('name')}") for t in tool.get("tools") or ()
                       if isinstance(t, dict) and t.get("type") == "function")
        elif kind == "custom":  # a single-string function shim
            out.append(_function({"description": tool.get("description"), "parameters": _CUSTOM_PARAMETERS},
                                 tool.get("name")))
        elif kind is None:
            raise ApiError(400, f"tools[{i}] must be an object with a 'type'", param="tools", code="invalid_type")
    return out or None


# vLLM's schema for a custom tool's one string argument
_CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string",
                                                                 "description": "The freeform text payload for this tool."}},
                      "required": ["input"], "additionalProperties": False}


def _function(tool: dict, name: Any) -> dict:
    if not isinstance(name, str) or "function" in tool:
        raise ApiError(400, "a function tool needs a string 'name' (the Responses API's flat shape)", param="tools",
                       code="invalid_type")
    fn = {"name": name, "description": tool.get("description"), "parameters": tool.get("parameters")}
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


def _template_kwargs(payload: dict, ctk: dict | None) -> dict | None:
    reasoning = payload.get("reasoning")
    return template_kwargs(ctk, reasoning_effort=reasoning.get("effort") if isinstance(reasoning, dict) else None)
