"""`n` > 1 choices and completions batches on the simulated replica, as vLLM 0.32 runs them: a
child engine request per prompt and choice (ids `{k}_{parent id}`), all added together, so a
prompt's first child computes it and the others find its blocks (a later prompt also finds an
earlier one's). The answer carries a choice per child (`index` k = prompt x n + choice); its usage
counts each prompt once and every child's output, and reports the cached tokens of the last
child when answered whole and of the child whose first token came first when streamed (what real
vLLM reported: tests/real_vllm/test_vllm_e2e.py). A client that goes away aborts every child.
The one-choice answer is the server's own (server.py).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from loadtests.sim.framing import Stream, aborted_event, aborted_response, end_stream
from loadtests.sim.scheduler import SimRequest

if TYPE_CHECKING:
    from loadtests.sim.server import SimServer

__all__ = ["add_children", "answer_choices"]

_json = msgspec.json.Encoder()


def add_children(server: "SimServer", first: SimRequest, st: Stream, p) -> list[tuple[SimRequest, Stream]]:
    """`first` (already queued: the first prompt's first choice) and the other children of the
    request `p` (openai_requests.ParsedRequest), queued now; all wake one event."""
    kids = [(first, st)]
    for k, ids in enumerate([ids for ids in _prompts(p) for _ in range(p.n)][1:], start=1):
        kst = Stream(st.t_arrival)
        kst.event = st.event
        req = SimRequest(f"{k}_{first.request_id}", list(ids), first.max_tokens, cache_salt=first.cache_salt,
                         report_full_hits=first.report_full_hits, arrival_s=first.arrival_s, priority=first.priority,
                         user=kst, lora=first.lora)
        server.engine.add_request(req)
        kids.append((req, kst))
    server._notify()
    return kids


def _prompts(p) -> list[list[int]]:
    return [p.prompt_ids, *(p.more_prompts or ())]


def _usage(server: "SimServer", p, kids: list, chat: bool, stream: bool) -> dict:
    reporter = min(kids, key=lambda k: k[1].t_first or float("inf")) if stream else kids[-1]
    u = server._usage(reporter[0], chat)
    prompt = sum(len(ids) for ids in _prompts(p))
    out = sum(r.num_output_tokens for r, _ in kids)
    return {**u, "prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}


async def answer_choices(server: "SimServer", request: web.Request, chat: bool, p, kids: list) -> web.StreamResponse:
    """The n-choice answer, whole or streamed (module header)."""
    rid, created, model = kids[0][0].request_id, int(time.time()), kids[0][0].lora or server.cfg.model
    event = kids[0][1].event
    try:
        if not p.stream:
            while not all(st.done for _, st in kids):
                await event.wait()
                event.clear()
                aborted = next((st.aborted for _, st in kids if st.aborted), None)
                if aborted:
                    return aborted_response(aborted)
            if chat:
                choices = [{"index": i, "message": {"role": "assistant", "content": server._text(0, st.n_delivered)},
                            "logprobs": None, "finish_reason": "length", "stop_reason": None} for i, (_, st) in enumerate(kids)]
            else:
                choices = [{"index": i, "text": server._text(0, st.n_delivered), "logprobs": None, "finish_reason": "length",
                            "stop_reason": None} for i, (_, st) in enumerate(kids)]
            return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                                      "model": model, "choices": choices, "usage": _usage(server, p, kids, chat, False)})
        return await _stream(server, request, chat, p, kids, (rid, created, model))
    finally:
        for req, st in kids:
            if not st.done and not st.aborted and server.engine.abort(req.request_id):
                server.num_aborted_total += 1


async def _stream(server: "SimServer", request: web.Request, chat: bool, p, kids: list, head: tuple) -> web.StreamResponse:
    rid, created, model = head
    obj = "chat.completion.chunk" if chat else "text_completion"
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    event, sent = kids[0][1].event, [0] * len(kids)

    def chunk(choice: dict) -> bytes:
        return b"data: " + _json.encode({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}) + b"\n\n"

    try:
        while True:
            await event.wait()
            event.clear()
            aborted = next((st.aborted for _, st in kids if st.aborted), None)
            if aborted:
                await resp.write(aborted_event(aborted))
                return resp
            parts: list[bytes] = []
            for i, (req, st) in enumerate(kids):
                n_out = st.n_delivered
                if n_out <= sent[i]:
                    continue
                if sent[i] == 0 and chat:
                    parts.append(chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}))
                last = st.done and n_out >= req.max_tokens
                text = server._text(sent[i], n_out)
                delta = {"delta": {"content": text}} if chat else {"text": text}
                parts.append(chunk({"index": i, **delta, "logprobs": None, "finish_reason": "length" if last else None}))
                sent[i] = n_out
            if all(st.done for _, st in kids):
                fin = {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                       "usage": _usage(server, p, kids, chat, True)}
                return await end_stream(resp, parts, fin if p.include_usage else None)
            if parts:
                await resp.write(b"".join(parts))
    except ConnectionResetError:
        return resp
