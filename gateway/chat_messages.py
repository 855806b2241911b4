"""Chat messages as vLLM hands them to the chat template (pure): the normalisation of vLLM's
`parse_chat_messages` + `_postprocess_messages`, the template's content format ("string" joins a
message's text parts with a newline, "openai" keeps them as `{"type": "text"}` parts), the
template's options as vLLM merges them from a request, and which template kwargs a template reads.
gateway.tokenization renders and encodes the result.

Media (images, audio, video): vLLM's processor turns each item into placeholder tokens whose count
only it knows, and its prefix cache keys a block that holds any of them with the item's hash; the
blocks before the first item are keyed as plain text. So a media part becomes MEDIA_MARK where
vLLM puts its placeholder (a "string" template: first in its message's content, one a line
before the text, as vLLM does without --interleave-mm-strings, else in the part's place among
the texts; an "openai" one: in the part's place, for the template to render in order), and
gateway.tokenization keys the text before the first mark (and counts the text after it).
`history_units` describes a chat past its first media item (each item of that message, its text,
then each later message) for hashing.history_keys.
"""
from __future__ import annotations

import copy
import functools
import inspect
import json
import logging
from typing import Any, Collection

import jinja2.meta
import jinja2.nodes as jn
import xxhash

from gateway.token_errors import TokenizationError, as_text

__all__ = ["detect_content_format", "to_conversation", "template_variables", "hf_base_params", "template_kwargs",
           "has_media", "has_part", "history_units", "MEDIA_MARK", "MEDIA_PART_TYPES", "TEXT_PART_KEYS"]

log = logging.getLogger("warmroute.gateway.tokenization")

# Text part types vLLM turns into plain text (vllm/entrypoints/chat_utils.py MM_PARSER_MAP).
TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}
# Part types vLLM hands to the model's multi-modal processor (the same map's media entries).
MEDIA_PART_TYPES = frozenset({"image_url", "input_image", "image_embeds", "image_pil", "audio_url", "input_audio",
                              "audio_embeds", "video_url", "video_embeds"})
MEDIA_MARK = "\ue000warmroute-media\ue000"  # where a media item's placeholder goes (private-use characters)


def has_part(messages: Any, types: Collection[str]) -> bool:
    """Does any message carry a content part of one of `types`?"""
    if not isinstance(messages, list):
        return False
    for m in messages:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, list) and any(isinstance(p, dict) and p.get("type") in types for p in c):
            return True
    return False


def has_media(messages: Any) -> bool:
    """Does any message carry a media content part (module header)?"""
    return has_part(messages, MEDIA_PART_TYPES)


# a media item's weight in history_units: fixed (a turn's keys must be the next turn's), at
# gateway.encode.MediaTokens' prior, not at what it learns
HISTORY_ITEM_TOKENS = 576


def history_units(messages: Any, *, in_part_order: bool = False) -> tuple[tuple[int, int], ...]:
    """The chat past its first media item as units of (a digest, estimated tokens): a function of
    the messages alone, so a conversation's next turn repeats them. The message with the first item
    gives one unit an item (its part's digest, HISTORY_ITEM_TOKENS), so that a popular image keys
    alike in every conversation that sends it after the same text, and then its text (the whole
    message's digest, four characters a token and four for its framing). Items come first, as a
    "string" template places them; `in_part_order` (an "openai" template, or the engines'
    --interleave-mm-strings) keeps the parts' order from the first item on, the text before it
    being the request's own keys. Each later message is one unit (its digest; its text, framing and
    items)."""
    if not isinstance(messages, list):
        return ()
    first = next((i for i, m in enumerate(messages) if has_media([m])), None)
    if first is None:
        return ()
    parts = _parts(messages[first])
    at = next(i for i, p in enumerate(parts) if _is_item(p))
    if in_part_order:
        out = [(_digest(p), HISTORY_ITEM_TOKENS if _is_item(p) else _text_chars([p]) // 4) for p in parts[at:]]
        out.append((_digest(messages[first]), 4))
    else:
        out = [(_digest(p), HISTORY_ITEM_TOKENS) for p in parts if _is_item(p)]
        out.append((_digest(messages[first]), 4 + _text_chars(parts) // 4))
    for m in messages[first + 1:]:
        ps = _parts(m)
        out.append((_digest(m), 4 + _text_chars(ps) // 4 + HISTORY_ITEM_TOKENS * sum(map(_is_item, ps))))
    return tuple(out)


def _parts(message: Any) -> list:
    content = message.get("content") if isinstance(message, dict) else None
    return [content] if isinstance(content, str) else content if isinstance(content, list) else []


def _is_item(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in MEDIA_PART_TYPES


def _digest(value: Any) -> int:
    """xxh3-64 of a JSON value's content (dict keys in order), walked without recursion: a body may
    nest near Python's recursion limit, and a JSON dump of a 10 MB image costs ~25 ms on the loop
    where this walk costs ~1 ms."""
    h = xxhash.xxh3_64()
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            b = v.encode("utf-8", "surrogatepass")
            h.update(b"s%d:" % len(b))
            h.update(b)
        elif isinstance(v, dict):
            h.update(b"d%d:" % len(v))
            for k in sorted(v, key=str, reverse=True):  # popped in order: each key, then its value
                stack.append(v[k])
                stack.append(str(k))
        elif isinstance(v, list):
            h.update(b"l%d:" % len(v))
            stack.extend(reversed(v))
        else:  # numbers, booleans, null
            h.update(b"o%s;" % repr(v).encode())
    return h.intdigest()


def _text_chars(parts: list) -> int:
    n = 0
    for p in parts:
        if isinstance(p, str):
            n += len(p)
        elif isinstance(p, dict) and isinstance(p.get("type"), str):
            text = p.get(TEXT_PART_KEYS.get(p["type"], ""))
            n += len(text) if isinstance(text, str) else 0
    return n


def _is_access(node: Any, names: set[str], key: str | None = None) -> bool:
    """Does `node` read one of `names` (optionally its `key` item/attribute), possibly through
    filters, tests or slices? Mirrors vLLM's content-format detection."""
    if isinstance(node, jn.Filter):
        return node.node is not None and _is_access(node.node, names, key)
    if isinstance(node, jn.Test):
        return _is_access(node.node, names, key)
    if isinstance(node, jn.Getitem) and isinstance(node.arg, jn.Slice):
        return _is_access(node.node, names, key)
    if key is None:
        return isinstance(node, jn.Name) and node.ctx == "load" and node.name in names
    if isinstance(node, jn.Getitem):
        return _is_access(node.node, names) and isinstance(node.arg, jn.Const) and node.arg.value == key
    if isinstance(node, jn.Getattr):
        return _is_access(node.node, names) and node.attr == key
    return False


@functools.lru_cache(maxsize=32)
def detect_content_format(chat_template: str) -> str:
    """"openai" if the template loops over a message's content (list of parts), else "string"."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        ast = _compile_jinja_template(chat_template).environment.parse(chat_template)
        msgs = {"messages"}
        changed = True
        while changed:  # variables assigned from `messages` (or slices / filters of it)
            changed = False
            for a in ast.find_all(jn.Assign):
                if isinstance(a.target, jn.Name) and a.target.name not in msgs and _is_access(a.node, msgs):
                    msgs.add(a.target.name)
                    changed = True
        loop_vars = {
            f.target.name for f in ast.find_all(jn.For) if isinstance(f.target, jn.Name) and _is_access(f.iter, msgs)
        }
        for f in ast.find_all(jn.For):
            if loop_vars and _is_access(f.iter, loop_vars, "content"):
                return "openai"
        return "string"
    except Exception:  # pragma: no cover - vLLM falls back to "string" as well
        log.debug("chat template content-format detection failed", exc_info=True)
        return "string"


def _parse_content(content: Any, role: str, fmt: str, index: int, interleave: bool) -> Any:
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = content
    else:
        raise TokenizationError(
            f"messages[{index}].content must be a string, a list of content parts or null, got {type(content).__name__}"
        )
    texts: list[str] = []
    media = 0
    for j, part in enumerate(parts):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise TokenizationError(f"messages[{index}].content[{j}] must be an object, got {type(part).__name__}")
        ptype = part.get("type")
        if ptype is None:
            raise TokenizationError(f"messages[{index}].content[{j}] has no 'type'")
        if ptype in MEDIA_PART_TYPES:  # module header: its placeholder's place
            media += 1
            if fmt == "openai" or interleave:
                texts.append(MEDIA_MARK)
            continue
        if ptype not in TEXT_PART_KEYS:
            raise TokenizationError(
                f"messages[{index}].content[{j}]: content part type {ptype!r} is not supported "
                "(supported: " + ", ".join(sorted(TEXT_PART_KEYS.keys() | MEDIA_PART_TYPES)) + ")"
            )
        text = part.get(TEXT_PART_KEYS[ptype])
        if text is None:  # vLLM skips text/refusal parts without content
            continue
        texts.append(as_text(text, f"messages[{index}].content[{j}].{TEXT_PART_KEYS[ptype]}"))
    if fmt == "openai":
        return [{"type": "text", "text": t} for t in texts]
    return "\n".join([MEDIA_MARK] * media + texts if not interleave else texts)  # vLLM: one placeholder a line each


def to_conversation(messages: Any, content_format: str, *, interleave: bool = False) -> list[dict[str, Any]]:
    """The conversation vLLM hands to the chat template for these OpenAI-style messages
    (`interleave`: the engine's --interleave-mm-strings)."""
    if not isinstance(messages, list):
        raise TokenizationError(f"messages must be a list, got {type(messages).__name__}")
    if not messages:
        raise TokenizationError("messages must not be empty")
    conv: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise TokenizationError(f"messages[{i}] must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str):
            raise TokenizationError(f"messages[{i}].role must be a string")
        out: dict[str, Any] = {"role": role, "content": _parse_content(msg.get("content"), role, content_format, i, interleave)}
        if role == "assistant":
            tool_calls = msg.get("tool_calls")
            if tool_calls is not None:
                if not isinstance(tool_calls, list):
                    raise TokenizationError(f"messages[{i}].tool_calls must be a list")
                tool_calls = copy.deepcopy(tool_calls)
                if tool_calls:
                    for item in tool_calls:
                        fn = item.get("function") if isinstance(item, dict) else None
                        if not isinstance(fn, dict):
                            raise TokenizationError(f"messages[{i}].tool_calls[*].function must be an object")
                        args = fn.get("arguments")
                        if isinstance(args, str):
                            try:
                                fn["arguments"] = json.loads(args)
                            except json.JSONDecodeError:
                                fn["arguments"] = {}
                        elif not isinstance(args, (dict, list)):
                            fn["arguments"] = {}
                    out["tool_calls"] = tool_calls
            reasoning = msg.get("reasoning")
            if reasoning is not None:
                out["reasoning"] = reasoning
                out["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in msg:
                out["tool_call_id"] = msg["tool_call_id"]
            c = out["content"]
            if isinstance(c, list):  # tool results are flattened to a string even for "openai"
                out["content"] = "\n".join(p["text"] for p in c) if c else ""
        if isinstance(msg.get("name"), str):
            out["name"] = msg["name"]
        if isinstance(msg.get("task"), str):
            out["task"] = msg["task"]
        if role == "developer":
            out["tools"] = msg.get("tools")
        conv.append(out)
    return conv


@functools.lru_cache(maxsize=32)
def template_variables(chat_template: str) -> frozenset[str]:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    env = _compile_jinja_template(chat_template).environment
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(chat_template)))


@functools.lru_cache(maxsize=1)
def hf_base_params() -> frozenset[str]:
    from transformers import PreTrainedTokenizerBase

    sig = inspect.signature(PreTrainedTokenizerBase.apply_chat_template)
    return frozenset(
        p.name for p in sig.parameters.values()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"
    )


def template_kwargs(ctk: dict | None, *, documents=None, reasoning_effort=None) -> dict | None:
    """The chat template's options as vLLM 0.32 merges them (`build_chat_params`): the request's
    `chat_template_kwargs`, overridden by `documents` and `reasoning_effort` when set, and
    `enable_thinking` = effort != "none" when an effort is set and the kwargs do not say
    (`add_generation_prompt` and `continue_final_message` travel apart: the request's own fields
    override any in the kwargs)."""
    out = {k: v for k, v in (ctk or {}).items() if k not in ("add_generation_prompt", "continue_final_message")}
    if documents is not None:
        out["documents"] = documents
    if reasoning_effort not in (None, "auto"):
        out["reasoning_effort"] = reasoning_effort
        if "enable_thinking" not in (ctk or {}):
            out["enable_thinking"] = reasoning_effort != "none"
    return out or None
