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
answers them.

Background responses (`background: true`, with the store), as vLLM runs them: stored at once as
`queued` (the answer to a whole request), the engine's request run on whether or not anyone
listens, the stored response replaced by the completed one (or marked `failed`) unless cancelled;
streamed, its events kept, sent to the creating client as they come and replayed from the start
or `starting_after` by `GET /v1/responses/{id}?stream=true` (a response that was not a streamed
background one: 400); `POST .../cancel` of one still queued or running marks it `cancelled` and
aborts the engine's request.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from gateway.errors import ApiError
from gateway.responses_api import chat_messages, turn_messages
from loadtests.sim.openai_requests import BadRequest

__all__ = ["chat_body", "create", "by_id", "ResponseStore", "not_found"]

_json = msgspec.json.Encoder()
# the Responses fields that mean the same on a chat request
_CARRIED = ("model", "stream", "cache_salt", "priority", "vllm_xargs", "chat_template_kwargs", "temperature", "top_p")


class ResponseStore:
    """The engine's stored responses and the messages each was rendered from (module header)."""

    def __init__(self) -> None:
        self.messages: dict[str, list] = {}
        self.responses: dict[str, dict] = {}
        self.background: dict[str, _Background] = {}

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
    if body.get("background") and (store is None or body.get("store") is False):
        raise BadRequest("background can only be used when `store` is true" if store is not None else
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


def _event(kind: str, seq: int, **fields: Any) -> tuple[str, bytes]:
    return kind, b"event: " + kind.encode() + b"\ndata: " + _json.encode({"type": kind, "sequence_number": seq, **fields}) + b"\n\n"


class _Run:
    """One response's generation as the engine delivers its tokens: its stream's events (when
    `streamed`), then `final` (the completed response object) or `error` (the engine dropped it)."""

    def __init__(self, server, req, st, streamed: bool, store: ResponseStore | None) -> None:
        self.server, self.req, self.st, self.streamed, self.store = server, req, st, streamed, store
        self.created = int(time.time())
        self.final: dict | None = None
        self.error: dict | None = None

    def response(self, status: str) -> dict:
        req = self.req
        return _response(req.request_id, req.lora or self.server.cfg.model, self.created, status, None, None)

    async def events(self):
        """Yields (event type, SSE bytes); stops after the last (none when not `streamed`)."""
        server, req, st = self.server, self.req, self.st
        rid, seq, sent = req.request_id, 0, 0
        item_id = f"msg_{rid[5:]}"
        if self.streamed:
            started = self.response("in_progress")
            yield _event("response.created", 0, response=started)
            yield _event("response.in_progress", 1, response=started)
            seq = 2
        while not st.done:
            await st.event.wait()
            st.event.clear()
            if st.aborted:
                self.error = {"message": f"request aborted: {st.aborted}", "type": "InternalServerError", "param": None, "code": 500}
                if self.streamed:
                    yield _event("error", seq, **self.error)
                return
            n_out = st.n_delivered
            if not self.streamed or n_out <= sent:
                continue
            if sent == 0:
                item = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
                yield _event("response.output_item.added", seq, output_index=0, item=item)
                yield _event("response.content_part.added", seq + 1, item_id=item_id, output_index=0, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": []})
                seq += 2
            yield _event("response.output_text.delta", seq, item_id=item_id, output_index=0, content_index=0,
                         delta=server._text(sent, n_out), logprobs=[])
            seq, sent = seq + 1, n_out
        text = server._text(0, st.n_delivered)
        self.final = done = _response(rid, req.lora or server.cfg.model, self.created, "completed", text, _usage(req))
        stored = None if self.store is None else self.store.responses.get(rid)
        if self.store is not None and (stored is None or stored["status"] != "cancelled"):
            self.store.responses[rid] = done  # before the last event, as vLLM does
        if self.streamed:
            yield _event("response.output_text.done", seq, item_id=item_id, output_index=0, content_index=0,
                         text=text, logprobs=[])
            yield _event("response.output_item.done", seq + 1, output_index=0, item=done["output"][0])
            yield _event("response.completed", seq + 2, response=done)

    def abort(self) -> None:
        """Drops the engine's request if it is still running (the client left, or a cancel)."""
        st, server = self.st, self.server
        if not st.done and not st.aborted and server.engine.abort(self.req.request_id):
            server.num_aborted_total += 1


class _Background:
    """A background response's run (vLLM's `background_tasks`, and `event_store` when streamed):
    the engine's request goes on whoever listens; its events kept for replay."""

    def __init__(self, run: _Run, store: ResponseStore) -> None:
        self.run, self.store = run, store
        self.events: list[tuple[str, bytes]] = []
        self.signal = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._go())

    async def _go(self) -> None:
        rid = self.run.req.request_id
        try:
            async for ev in self.run.events():
                self.events.append(ev)
                self.signal.set()
        finally:
            self.run.abort()
            self.signal.set()
            stored = self.store.responses[rid]
            if self.run.error is not None and stored["status"] != "cancelled":
                stored["status"] = "failed"

    async def replay(self, starting_after: int | None):
        """The events after `starting_after`, then each as it comes, to `response.completed`."""
        i = 0 if starting_after is None else starting_after + 1
        while True:
            self.signal.clear()
            while i < len(self.events):
                kind, data = self.events[i]
                yield data
                if kind == "response.completed":
                    return
                i += 1
            if self.task.done():
                return
            await self.signal.wait()


async def _sse(request: web.Request, chunks) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        async for data in chunks:
            await resp.write(data)
        await resp.write_eof()
    except ConnectionResetError:  # the client went away mid-stream
        pass
    return resp


async def create(server, request: web.Request, body: dict) -> web.StreamResponse:
    """`POST /v1/responses`: queued in the engine, then answered whole, streamed, or (background)
    stored as queued and run on."""
    store: ResponseStore | None = server.stored
    rid = body.get("request_id") if isinstance(body.get("request_id"), str) else f"resp_{uuid.uuid4().hex}"
    chat = chat_body(body, store)
    p, req, st = await server._admit(request, chat, True, rid)
    keep = store is not None and body.get("store", True) is not False
    run = _Run(server, req, st, bool(p.stream), store if keep else None)
    if keep:
        store.messages[rid] = chat["messages"]
    if body.get("background"):
        store.responses[rid] = run.response("queued")
        bg = store.background[rid] = _Background(run, store)
        return await _sse(request, bg.replay(None)) if p.stream else web.json_response(store.responses[rid])
    try:
        if p.stream:
            return await _sse(request, (data async for _, data in run.events()))
        async for _ in run.events():
            pass
        if run.error is not None:
            return web.Response(body=_json.encode({"error": run.error}), status=500, content_type="application/json")
        return web.Response(body=_json.encode(run.final), content_type="application/json")
    finally:
        run.abort()


async def by_id(server, request: web.Request) -> web.StreamResponse:
    """`GET /v1/responses/{id}` (`?stream=true&starting_after=N`: a streamed background response's
    events replayed) and `POST /v1/responses/{id}/cancel` (a background response still running)."""
    rid = request.match_info["rid"]
    store: ResponseStore | None = server.stored
    if store is None:
        raise not_found(rid, "response_id")
    stored = store.get(rid)
    if request.path.endswith("/cancel"):
        if stored["status"] not in ("queued", "in_progress"):
            raise BadRequest("Cannot cancel a synchronous response.", "response_id")
        stored["status"] = "cancelled"
        bg = store.background.get(rid)
        if bg is not None:
            bg.task.cancel()
            await asyncio.gather(bg.task, return_exceptions=True)
        return web.json_response(stored)
    if request.query.get("stream", "").lower() == "true":
        bg = store.background.get(rid)
        if bg is None or not bg.run.streamed:
            raise BadRequest(f"Unknown response_id: {rid}", "response_id")
        after = request.query.get("starting_after")
        try:
            return await _sse(request, bg.replay(int(after) if after is not None else None))
        except ValueError:
            raise BadRequest("starting_after must be an integer", "starting_after") from None
    return web.json_response(stored)
