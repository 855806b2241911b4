"""The simulated replica's OpenAI Responses API (`POST /v1/responses`), as vLLM 0.32 serves it for
a model without Harmony: the request rendered as a chat (its messages as gateway.responses_api
builds them from `instructions` and `input`: one statement of vLLM's rules, checked against vLLM's
own functions in tests/fixtures), the answer a `response` object, or a stream of named events
(`event: <type>` + `data: <json>`): `response.created` and `response.in_progress` at once, the
output item and content part when the first token comes, one `response.output_text.delta` per
delivery, then the `.done` events and `response.completed` with the usage (`input_tokens`,
`input_tokens_details.cached_tokens`, `output_tokens`); no `[DONE]`. Tools are accepted and not
rendered (the simulator's chat template path has none).

Stored responses (`SimConfig.responses_store`, vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1), as vLLM
keeps them: each answered response (unless `store` is false) under its `request_id` (the body's,
else a fresh one), with the whole list of messages it was rendered from; a `previous_response_id`
renders that list bar its system messages, then the stored answer's text parts as assistant
messages, between the new instructions and the new input; `GET /v1/responses/{id}` returns a
stored response, `POST /v1/responses/{id}/cancel` refuses it as synchronous (400); an id not
stored is 404. Without the store a `previous_response_id` is 404 and `background` 400, as vLLM
answers them. Background responses themselves are not simulated (400).
"""
from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from gateway.errors import ApiError
from gateway.responses_api import chat_messages, turn_messages
from loadtests.sim.openai_requests import BadRequest

__all__ = ["chat_body", "answer", "ResponseStore", "not_found"]

_json = msgspec.json.Encoder()
# the Responses fields that mean the same on a chat request
_CARRIED = ("model", "stream", "cache_salt", "priority", "vllm_xargs", "chat_template_kwargs", "temperature", "top_p")


class ResponseStore:
    """The engine's stored responses and the messages each was rendered from (module header)."""

    def __init__(self) -> None:
        self.messages: dict[str, list] = {}
        self.responses: dict[str, dict] = {}

    def get(self, response_id: str) -> dict:
        if response_id not in self.responses:
            raise not_found(response_id, "response_id")
        return self.responses[response_id]

    def history(self, response_id: str) -> list[dict]:
        """vLLM's `construct_input_messages` with the stored `prev_msg` and `prev_response_output`."""
        if response_id not in self.responses:
            raise not_found(response_id, "previous_response_id")
        out = [m for m in self.messages[response_id] if m.get("role") != "system"]
        for item in self.responses[response_id]["output"]:
            if item.get("type") == "message":
                out += [{"role": "assistant", "content": c["text"]} for c in item["content"]]
        return out


def not_found(response_id: str, param: str) -> BadRequest:
    return BadRequest(f"Response with id '{response_id}' not found.", param, 404, "NotFoundError")


def chat_body(body: dict, store: ResponseStore | None = None) -> dict:
    """The chat request the engine runs for a Responses body (`store`: the engine's stored responses)."""
    if body.get("background"):
        raise BadRequest("background responses are not simulated" if store is not None else
                         "This vLLM engine does not support `store=True` and therefore does not support the "
                         "background mode.", "background")
    prev = body.get("previous_response_id")
    if prev is not None and store is None:
        raise not_found(prev, "previous_response_id")  # vLLM without VLLM_ENABLE_RESPONSES_API_STORE keeps none
    try:
        if prev is None:
            messages = chat_messages(body.get("instructions"), body.get("input"))
        else:
            messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
            messages += store.history(prev) + turn_messages(body.get("input"))
    except ApiError as e:
        raise BadRequest(e.message, e.param) from None
    out = {k: body[k] for k in _CARRIED if k in body}
    out["messages"] = messages
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    return out


def _usage(req) -> dict:
    return {"input_tokens": req.num_prompt_tokens, "input_tokens_details": {"cached_tokens": max(req.num_cached_tokens, 0)},
            "output_tokens": req.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": req.num_prompt_tokens + req.num_output_tokens}


def _response(rid: str, model: str, created: int, status: str, text: str | None, usage: dict | None) -> dict:
    output = [] if text is None else [{"id": f"msg_{rid[5:]}", "type": "message", "role": "assistant",
                                       "status": "completed", "content": [{"type": "output_text", "text": text,
                                                                           "annotations": [], "logprobs": None}]}]
    return {"id": rid, "object": "response", "created_at": created, "model": model, "status": status,
            "output": output, "usage": usage, "error": None, "incomplete_details": None, "tools": [],
            "parallel_tool_calls": True, "tool_choice": "auto"}


def _event(kind: str, seq: int, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _json.encode({"type": kind, "sequence_number": seq, **fields}) + b"\n\n"


async def answer(server, request: web.Request, p, req, st, keep: list | None = None) -> web.StreamResponse:
    """The answer to a queued request (`server._admit`), whole or streamed, as tokens are delivered;
    `keep`: the messages it was rendered from, stored with it once whole (None: not stored)."""
    rid, model, created = req.request_id, req.lora or server.cfg.model, int(time.time())
    resp: web.StreamResponse | None = None
    seq = 0
    try:
        if p.stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            started = _response(rid, model, created, "in_progress", None, None)
            await resp.write(_event("response.created", 0, response=started) + _event("response.in_progress", 1, response=started))
            seq = 2
        sent = 0
        while not st.done:
            await st.event.wait()
            st.event.clear()
            if st.aborted:
                err = {"error": {"message": f"request aborted: {st.aborted}", "type": "InternalServerError", "param": None, "code": 500}}
                if resp is None:
                    return web.Response(body=_json.encode(err), status=500, content_type="application/json")
                await resp.write(_event("error", seq, **err["error"]))
                return resp
            n_out = st.n_delivered
            if resp is None or n_out <= sent:
                continue
            parts = []
            if sent == 0:
                item = {"id": f"msg_{rid[5:]}", "type": "message", "role": "assistant", "status": "in_progress", "content": []}
                parts += [_event("response.output_item.added", seq, output_index=0, item=item),
                          _event("response.content_part.added", seq + 1, item_id=item["id"], output_index=0,
                                 content_index=0, part={"type": "output_text", "text": "", "annotations": []})]
                seq += 2
            parts.append(_event("response.output_text.delta", seq, item_id=f"msg_{rid[5:]}", output_index=0,
                                content_index=0, delta=server._text(sent, n_out), logprobs=[]))
            seq, sent = seq + 1, n_out
            await resp.write(b"".join(parts))
        text = server._text(0, st.n_delivered)
        done = _response(rid, model, created, "completed", text, _usage(req))
        if keep is not None:
            server.stored.messages[rid], server.stored.responses[rid] = keep, done
        if resp is None:
            return web.Response(body=_json.encode(done), content_type="application/json")
        await resp.write(_event("response.output_text.done", seq, item_id=f"msg_{rid[5:]}", output_index=0,
                                content_index=0, text=text, logprobs=[])
                         + _event("response.output_item.done", seq + 1, output_index=0, item=done["output"][0])
                         + _event("response.completed", seq + 2, response=done))
        await resp.write_eof()
        return resp
    except ConnectionResetError:  # the client went away mid-stream
        return resp
    finally:
        if not st.done and not st.aborted and server.engine.abort(rid):
            server.num_aborted_total += 1
