"""The simulated vLLM replica's HTTP server (aiohttp): vLLM's OpenAI routes around a SimEngine.

What it owns: the routes, the engine loop task, KV-event publishing, faults. Beside it: its
configuration (config.py), vLLM's request rules and tokenization (openai_requests.py), vLLM's
error bodies and stream endings (framing.py), its metrics (metrics.py). The engine core (scheduler.py,
blockpool.py) is pure and knows nothing of this file.

Engine loop (one task per server): while there is work, run `engine.step()`, sleep until
`t_start + modelled duration` (an absolute deadline, so CPU spent in the step counts against the
modelled time), then publish the step's KV events and wake the streams whose requests got tokens.
`lateness_s = t_end - deadline` measures how far the real clock fell behind the model (timer
slack, a CPU-saturated process); `/sim/stats` and `/metrics` expose it.

Routes: POST /v1/completions, /v1/chat/completions (`n` choices and batches: choices.py), /v1/responses (stream or not; responses.py), /tokenize, /detokenize,
/v1/completions/render, /v1/chat/completions/render, /reset_prefix_cache; GET /health,
/v1/models, /metrics, /kv_event_sources, /version; admin POST /sim/fault, GET /sim/stats, GET
/sim/trace (per-request and per-step timelines, when started with `trace`). Anything
else is a 404, as on vLLM.

LoRA (`lora_modules`, `max_loras`): the adapters are served names without weights; a request for
one runs as the model does, its blocks hashed and reported apart (the adapter on every block, as
vLLM does), and the engine batches at most `max_loras` adapters (scheduler.py); `/v1/models` lists
them with the model as parent and `/metrics` has vllm:lora_requests_info (unless `lora_metrics`
is off).

Faults (POST /sim/fault {"kind": ...}, or CLI flags): "crash" (/health 503, every other route 500,
live streams cut; with "refuse": true the listening socket closes: connections refused),
"stall" {"duration_s"} (no steps for that long), "drop_events" {"fraction"} (PUB batches skipped,
their seq consumed: a gap), "restart" (all requests dropped, empty cache, events seq back to 0 and
replay emptied, like a new process), "slow" {"factor"} (step times x factor), "recover" (restart
after a crash), "clear" (drop and slow factors back to normal).
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from loadtests.sim import choices, responses
from loadtests.sim.config import SimConfig, config_from_args
from loadtests.sim.framing import Stream, aborted_event, aborted_response, end_stream, error_response, json_response
from loadtests.sim.kv_events import KVEventPublisher
from loadtests.sim.metrics import SimMetrics
from loadtests.sim.openai_requests import BadRequest, RequestReader, check_type, read_json_body
from loadtests.sim.scheduler import SimEngine, SimRequest
from loadtests.sim.tokenize import SimTokenizer

__all__ = ["SimConfig", "SimServer", "RunningSim", "start_sim_server", "main_from_args", "config_from_args"]

log = logging.getLogger("warmroute.sim")
_json = msgspec.json.Encoder()
_FILLER_TEXT = " the quick brown fox jumps over the lazy dog"


class SimServer:
    """One simulated replica: engine, tokenizer, publisher, HTTP app."""

    def __init__(self, cfg: SimConfig, tokenizer: SimTokenizer | None = None) -> None:
        self.cfg = cfg
        self.stored = responses.ResponseStore() if cfg.responses_store else None  # the engine's stored Responses
        if tokenizer is None:
            tok_dir = cfg.tokenizer
            if tok_dir is None:
                from gateway.default_tokenizer import default_tokenizer_dir

                tok_dir = str(default_tokenizer_dir())
            tokenizer = SimTokenizer(tok_dir)
        self.tokenizer = tokenizer
        self._filler_ids = tuple(tokenizer.encode(_FILLER_TEXT, add_special_tokens=False))
        self._filler_text = [tokenizer.decode_one(t) for t in self._filler_ids]
        self.engine = self._new_engine()
        capacity_tokens = self.engine.pool.num_blocks * cfg.block_size
        if cfg.max_model_len > capacity_tokens:
            log.warning("max_model_len %d exceeds KV capacity %d tokens; clamping (vLLM would refuse to start)", cfg.max_model_len, capacity_tokens)
        self.max_model_len = min(cfg.max_model_len, capacity_tokens)
        self.requests = RequestReader(tokenizer, max_model_len=self.max_model_len, default_max_tokens=cfg.default_max_tokens,
                                      scheduling_policy=cfg.scheduling_policy, media=cfg.multimodal,
                                      media_tokens=cfg.media_tokens)
        self.publisher: KVEventPublisher | None = None
        self.host = "127.0.0.1"
        self.port = 0
        self.crashed = False
        self._refusing = False  # crash with "refuse": the listening socket is closed
        self._stall_until = 0.0
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._timers: list[asyncio.TimerHandle] = []
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._created = int(time.time())
        self._req_counter = 0
        self.metrics = SimMetrics()  # the TTFT histogram, the time model's fidelity
        # timelines (SimConfig.trace): each request at its first token, each step; times are loop.time()
        # (CLOCK_MONOTONIC, comparable with a client's time.perf_counter() on the same Linux machine)
        self.trace_requests: deque[dict] = deque(maxlen=50000)
        self.trace_steps: deque[tuple] = deque(maxlen=200000)  # (t_start, t_end, prefill tokens, decode seqs, running, waiting)
        self.num_aborted_total = 0  # requests whose client went away
        self.app = self._build_app()

    def _new_engine(self) -> SimEngine:
        ecfg = self.cfg.engine_config()
        ecfg.filler_token_ids = self._filler_ids
        eng = SimEngine(ecfg)
        eng.slow_factor = self.cfg.slow_factor
        return eng

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self._wake = asyncio.Event()
        try:
            await self._start(host, port)
        except BaseException:  # a taken port or endpoint: release what was opened (ZMQ would block exit)
            await self.close()
            raise

    async def _start(self, host: str, port: int) -> None:
        cfg = self.cfg
        if cfg.kv_events_endpoint:
            self.publisher = KVEventPublisher(
                cfg.kv_events_endpoint,
                cfg.replay_endpoint,
                topic=cfg.kv_events_topic,
                buffer_steps=cfg.kv_events_buffer_steps,
                events_format=cfg.events_format,
                data_parallel_rank=cfg.data_parallel_rank,
            )
            self.publisher.drop_fraction = cfg.drop_events_fraction
            self.publisher.start()
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, host, port)
        await self._site.start()
        self.port = self._runner.addresses[0][1]
        self._loop_task = asyncio.get_running_loop().create_task(self._engine_loop())
        loop = asyncio.get_running_loop()
        if cfg.crash_after_s is not None:
            self._timers.append(loop.call_later(cfg.crash_after_s, lambda: self.apply_fault({"kind": "crash"})))
        if cfg.stall_after_s is not None:
            self._timers.append(loop.call_later(cfg.stall_after_s, lambda: self.apply_fault({"kind": "stall", "duration_s": cfg.stall_s})))

    async def close(self) -> None:
        for t in self._timers:
            t.cancel()
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self._drop_all("server shutting down")
        if self._runner is not None:
            await self._runner.cleanup()
        if self.publisher is not None:
            await self.publisher.close()

    # -- engine loop ---------------------------------------------------------------------------
    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake
        assert wake is not None
        while True:
            if self.crashed or not self.engine.has_work:
                wake.clear()
                await wake.wait()
                continue
            now = loop.time()
            if self._stall_until > now:
                await asyncio.sleep(self._stall_until - now)
                continue
            engine = self.engine
            t0 = loop.time()
            out = engine.step()
            events = engine.take_events()
            modelled = out.duration_s
            deadline = t0 + modelled
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)  # let handlers run even when the model is behind
            t1 = loop.time()
            if engine is not self.engine or self.crashed:  # restarted or crashed during the step
                continue
            self.metrics.observe_step(modelled, t1 - t0, t1 - deadline)
            if self.cfg.trace:
                self.trace_steps.append((t0, t1, out.num_prefill_tokens, out.num_decode_seqs, engine.num_running, engine.num_waiting))
                for r in engine.running:  # scheduled in this step for the first time
                    st = r.user  # type: ignore[assignment]
                    if isinstance(st, Stream) and st.t_sched is None and r.num_cached_tokens >= 0:
                        st.t_sched = t0
            if events and self.publisher is not None:
                self.publisher.publish(events)
            for r in out.tokens:
                st: Stream | None = r.user  # type: ignore[assignment]
                if st is None:
                    continue
                if st.t_first is None:
                    st.t_first = t1
                    self.metrics.observe_ttft(t1 - st.t_arrival)
                    if st.trace is not None:
                        st.trace.update(t_sched=st.t_sched, t_first=t1, cached=r.num_cached_tokens,
                                        preemptions=r.num_preemptions)
                        self.trace_requests.append(st.trace)
                st.n_delivered = r.num_output_tokens
                st.event.set()
            for r in out.finished:
                st = r.user  # type: ignore[assignment]
                if st is not None:
                    st.done = True
                    st.event.set()
                    if st.trace is not None:
                        st.trace["t_done"] = t1
            if not out.tokens and out.num_prefill_tokens == 0 and out.num_decode_seqs == 0:
                await asyncio.sleep(0.001)  # nothing schedulable: do not spin

    def _drop_all(self, reason: str) -> None:
        for r in self.engine.abort_all():
            st = r.user
            if isinstance(st, Stream):
                st.aborted = reason
                st.event.set()

    # -- faults --------------------------------------------------------------------------------
    def apply_fault(self, spec: dict) -> dict:
        kind = spec.get("kind")
        if kind == "crash":
            self.crashed = True
            self._drop_all("engine dead")
            if spec.get("refuse") and self._site is not None:
                asyncio.get_running_loop().create_task(self._refuse())
        elif kind in ("recover", "restart"):
            self._drop_all("engine restarted")
            self.engine = self._new_engine()
            if self.publisher is not None:
                self.publisher.reset()
            self._stall_until = 0.0
            was_refusing = self._refusing
            self._refusing = False
            self.crashed = False
            if was_refusing:
                asyncio.get_running_loop().create_task(self._restart_site())
        elif kind == "stall":
            duration = float(spec.get("duration_s", 5.0))
            self._stall_until = asyncio.get_running_loop().time() + duration
        elif kind == "drop_events":
            fraction = float(spec.get("fraction", 0.5))
            if not 0.0 <= fraction <= 1.0:
                raise BadRequest("'fraction' must be within 0..1", "fraction")
            if self.publisher is not None:
                self.publisher.drop_fraction = fraction
        elif kind == "slow":
            factor = float(spec.get("factor", 2.0))
            if factor <= 0:
                raise BadRequest("'factor' must be positive", "factor")
            self.engine.slow_factor = factor
            self.cfg.slow_factor = factor
        elif kind == "clear":
            self.engine.slow_factor = self.cfg.slow_factor = 1.0
            self._stall_until = 0.0
            if self.publisher is not None:
                self.publisher.drop_fraction = 0.0
        else:
            raise BadRequest(f"unknown fault kind {kind!r}; one of crash, stall, drop_events, restart, slow, recover, clear", "kind")
        self._notify()
        return {"ok": True, "kind": kind}

    async def _refuse(self) -> None:
        """A dead process: the listening socket closes and open connections drop."""
        self._refusing = True
        if self._site is not None:
            await self._site.stop()
        await asyncio.sleep(0.01)  # let the /sim/fault reply go out first
        server = self._runner.server if self._runner is not None else None
        for conn in list(getattr(server, "connections", []) or []):
            conn.force_close()

    async def _restart_site(self) -> None:
        assert self._runner is not None
        self._site = web.TCPSite(self._runner, self.host, self.port)
        await self._site.start()

    # -- app -----------------------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024**2)
        r = app.router
        r.add_post("/v1/completions", self.h_completions)
        r.add_post("/v1/chat/completions", self.h_chat)
        r.add_post("/v1/responses", self.h_responses)
        r.add_get("/v1/responses/{rid}", self.h_stored_response)
        r.add_post("/v1/responses/{rid}/cancel", self.h_stored_response)
        r.add_post("/tokenize", self.h_tokenize)
        r.add_post("/detokenize", self.h_detokenize)
        r.add_post("/v1/completions/render", self.h_render_completions)
        r.add_post("/v1/chat/completions/render", self.h_render_chat)
        r.add_post("/reset_prefix_cache", self.h_reset_prefix_cache)
        r.add_get("/health", self.h_health)
        r.add_get("/v1/models", self.h_models)
        r.add_get("/metrics", self.h_metrics)
        r.add_get("/kv_event_sources", self.h_kv_event_sources)
        r.add_get("/version", self.h_version)
        r.add_post("/sim/fault", self.h_fault)
        r.add_get("/sim/stats", self.h_stats)
        r.add_get("/sim/trace", self.h_trace)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        if self.crashed and request.path not in ("/health", "/sim/fault", "/sim/stats"):
            return error_response("EngineCore encountered an issue (simulated crash).", 500, "InternalServerError")
        try:
            return await handler(request)
        except BadRequest as e:
            return error_response(e.message, e.status, e.err_type, e.param)
        except web.HTTPNotFound:
            return web.Response(body=b'{"detail":"Not Found"}', status=404, content_type="application/json")
        except web.HTTPMethodNotAllowed:
            return web.Response(body=b'{"detail":"Method Not Allowed"}', status=405, content_type="application/json")

    async def _body(self, request: web.Request) -> dict:
        return read_json_body(await request.read(), self.cfg.model, self.cfg.lora_modules)

    # -- generation ----------------------------------------------------------------------------
    async def h_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def h_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def _usage(self, req: SimRequest, chat: bool) -> dict:
        return {
            "prompt_tokens": req.num_prompt_tokens,
            "total_tokens": req.num_prompt_tokens + req.num_output_tokens,
            "completion_tokens": req.num_output_tokens,
            "prompt_tokens_details": {
                "cached_tokens": max(req.num_cached_tokens, 0),
                "created_cache_tokens": req.num_created_cache_tokens if chat else None,
                "multimodal_tokens": None,
            },
            "completion_tokens_details": None,
        }

    def _text(self, start: int, end: int) -> str:
        ft = self._filler_text
        n = len(ft)
        return "".join(ft[k % n] for k in range(start, end))

    async def h_responses(self, request: web.Request) -> web.StreamResponse:
        return await responses.create(self, request, await self._body(request))

    async def h_stored_response(self, request: web.Request) -> web.StreamResponse:
        return await responses.by_id(self, request)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await self._body(request)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        p, req, st = await self._admit(request, body, chat, rid)
        if p.n > 1 or p.more_prompts:
            return await choices.answer_choices(self, request, chat, p, choices.add_children(self, req, st, p))
        return await self.stream_answer(request, chat, p, req, st)

    async def _admit(self, request: web.Request, body: dict, chat: bool, rid: str) -> tuple[Any, SimRequest, "Stream"]:
        """Parse a generation body, and queue its request in the engine."""
        p = await self.requests.parse(body, chat)
        self._req_counter += 1
        st = Stream(asyncio.get_running_loop().time())
        lora = body.get("model") if body.get("model") in self.cfg.lora_modules else None
        req = SimRequest(rid, p.prompt_ids, p.max_tokens, cache_salt=p.cache_salt, report_full_hits=p.report_full, arrival_s=st.t_arrival,
                         priority=p.priority, user=st, lora=lora)
        engine = self.engine
        if self.cfg.trace:
            st.trace = {"id": request.headers.get("X-Request-Id", rid), "t_arrival": st.t_arrival,
                        "running_at_arrival": engine.num_running, "waiting_at_arrival": engine.num_waiting,
                        "prompt": len(p.prompt_ids)}
        try:
            engine.add_request(req)
        except ValueError as e:
            raise BadRequest(str(e), "max_tokens") from None
        self._notify()
        return p, req, st

    async def stream_answer(self, request: web.Request, chat: bool, p, req: SimRequest, st: "Stream") -> web.StreamResponse:
        """A chat or completions request's answer, whole or streamed, as the engine delivers its tokens."""
        rid, created, model = req.request_id, int(time.time()), req.lora or self.cfg.model
        resp: web.StreamResponse | None = None
        engine = self.engine
        try:
            if not p.stream:
                while not st.done:
                    await st.event.wait()
                    st.event.clear()
                    if st.aborted:
                        return aborted_response(st.aborted)
                text = self._text(0, st.n_delivered)
                if chat:
                    choice = {
                        "index": 0,
                        "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                                    "function_call": None, "tool_calls": [], "reasoning_content": None},
                        "logprobs": None, "finish_reason": "length", "stop_reason": None,
                    }
                    obj = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
                           "service_tier": None, "system_fingerprint": None, "usage": self._usage(req, chat),
                           "prompt_logprobs": None, "kv_transfer_params": None}
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None, "prompt_logprobs": None}
                    obj = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice],
                           "usage": self._usage(req, chat), "kv_transfer_params": None}
                return json_response(obj)

            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            obj_name = "chat.completion.chunk" if chat else "text_completion"
            sent = 0
            while True:
                await st.event.wait()
                st.event.clear()
                if st.aborted:
                    # the engine died mid-stream: vLLM ends the stream with an error event
                    await resp.write(aborted_event(st.aborted))
                    return resp
                n_out = st.n_delivered
                parts: list[bytes] = []
                if sent == 0 and n_out > 0 and chat:
                    first = {"id": rid, "object": obj_name, "created": created, "model": model,
                             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
                    if p.include_usage and p.continuous_usage:
                        first["usage"] = {"prompt_tokens": req.num_prompt_tokens, "total_tokens": req.num_prompt_tokens, "completion_tokens": 0}
                    parts.append(b"data: " + _json.encode(first) + b"\n\n")
                if n_out > sent:
                    last = st.done and n_out >= req.max_tokens
                    text = self._text(sent, n_out)
                    if chat:
                        ch: dict = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": "length" if last else None}
                    else:
                        ch = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length" if last else None}
                    if last:
                        ch["stop_reason"] = None
                    chunk: dict = {"id": rid, "object": obj_name, "created": created, "model": model, "choices": [ch]}
                    if p.include_usage and p.continuous_usage:
                        chunk["usage"] = {"prompt_tokens": req.num_prompt_tokens, "total_tokens": req.num_prompt_tokens + n_out,
                                          "completion_tokens": n_out}
                    parts.append(b"data: " + _json.encode(chunk) + b"\n\n")
                    sent = n_out
                if st.done:
                    fin = {"id": rid, "object": obj_name, "created": created, "model": model, "choices": [], "usage": self._usage(req, chat)}
                    return await end_stream(resp, parts, fin if p.include_usage else None)
                if parts:
                    await resp.write(b"".join(parts))
        except ConnectionResetError:  # the client went away mid-stream: nothing left to answer (finally frees its blocks)
            return resp
        finally:
            if not st.done and not st.aborted:
                # client went away (handler cancelled or write failed): free its blocks
                if engine.abort(rid):
                    self.num_aborted_total += 1

    # -- tokenization routes -------------------------------------------------------------------
    async def _tokens_for(self, body: dict) -> list[int]:
        if "messages" in body:
            return await self.requests.prompt_ids(body, chat=True, add_special_default=False)
        return await self.requests.prompt_ids(body, chat=False, add_special_default=True)

    async def h_tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        ids = await self._tokens_for(body)
        rts = check_type(body, "return_token_strs", (bool,), "a boolean")
        return json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                               "token_strs": self.tokenizer.token_strs(ids) if rts else None})

    async def h_detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise BadRequest("'tokens' must be a list of token ids", "tokens")
        return json_response({"prompt": self.tokenizer.hf.decode(toks)})

    async def h_render_completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        return json_response({"token_ids": await self.requests.prompt_ids(body, chat=False, add_special_default=True)})

    async def h_render_chat(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        return json_response({"token_ids": await self.requests.prompt_ids(body, chat=True, add_special_default=False)})

    async def h_reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.engine.reset_prefix_cache()
        # vLLM drains events with the next step; publish now if nothing will step soon
        if not self.engine.has_work and self.publisher is not None:
            self.publisher.publish(self.engine.take_events())
        return web.Response(status=200)

    # -- info routes ---------------------------------------------------------------------------
    async def h_health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.crashed else 200)

    async def h_version(self, request: web.Request) -> web.Response:
        return json_response({"version": "0.33.0+warmroute.sim"})

    async def h_models(self, request: web.Request) -> web.Response:
        m = self.cfg.model

        def card(name: str, parent: str | None) -> dict:
            return {"id": name, "object": "model", "created": self._created, "owned_by": "vllm", "root": name if parent is None else f"/adapters/{name}",
                    "parent": parent, "max_model_len": self.max_model_len if parent is None else None,
                    "permission": [{"id": f"modelperm-{name}", "object": "model_permission", "created": self._created, "allow_create_engine": False,
                                    "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                    "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}]}

        return json_response({"object": "list", "data": [card(m, None), *(card(a, m) for a in self.cfg.lora_modules)]})

    def kv_event_sources(self) -> list[dict]:
        cfg = self.cfg
        if not cfg.kv_events_endpoint:
            return []
        host = self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1"

        def resolve(ep: str | None) -> str | None:
            if ep is None:
                return None
            return ep.replace("*", host) if ep.startswith("tcp://") else ep

        return [{"data_parallel_rank": cfg.data_parallel_rank, "endpoint": resolve(cfg.kv_events_endpoint),
                 "replay_endpoint": resolve(cfg.replay_endpoint), "topic": cfg.kv_events_topic}]

    async def h_kv_event_sources(self, request: web.Request) -> web.Response:
        return json_response(self.kv_event_sources())

    def stats(self) -> dict:
        eng = self.engine
        return {
            **self.metrics.timing(),
            "num_running": eng.num_running,
            "num_waiting": eng.num_waiting,
            "kv_cache_usage": eng.pool.usage,
            "num_blocks": eng.pool.num_blocks,
            "num_preemptions": eng.num_preemptions_total,
            "num_lora_waits": eng.num_lora_waits_total,  # requests that waited for a LoRA slot
            "prefix_cache_queries_tokens": eng.prefix_cache_queries_tokens_total,
            "prefix_cache_hits_tokens": eng.prefix_cache_hits_tokens_total,
            "num_aborted": self.num_aborted_total,
            "crashed": self.crashed,
            "slow_factor": eng.slow_factor,
            "events_seq": self.publisher.seq if self.publisher else None,
            "events_dropped": self.publisher.num_dropped if self.publisher else None,
        }

    async def h_stats(self, request: web.Request) -> web.Response:
        return json_response(self.stats())

    async def h_trace(self, request: web.Request) -> web.Response:
        """The timelines kept since the last `?clear=1` (empty unless SimConfig.trace)."""
        out = {"max_num_seqs": self.cfg.max_num_seqs, "requests": list(self.trace_requests),
               "steps": [list(s) for s in self.trace_steps]}
        if request.query.get("clear") == "1":
            self.trace_requests.clear()
            self.trace_steps.clear()
        return json_response(out)

    async def h_fault(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            spec = json.loads(raw)
        except ValueError as e:
            raise BadRequest(f"Invalid JSON body: {e}") from None
        if not isinstance(spec, dict):
            raise BadRequest("The request body must be a JSON object")
        try:
            return json_response(self.apply_fault(spec))
        except (TypeError, ValueError) as e:
            raise BadRequest(str(e)) from None

    def metrics_text(self) -> str:
        return self.metrics.prometheus_text(self.engine, self.cfg)

    async def h_metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text(), content_type="text/plain", charset="utf-8")


@dataclass
class RunningSim:
    """A simulator serving in this process (from `start_sim_server`)."""

    server: SimServer
    url: str
    port: int

    @property
    def engine(self) -> SimEngine:
        return self.server.engine

    async def close(self) -> None:
        await self.server.close()


_TOKENIZERS: dict[str, SimTokenizer] = {}


def _shared_tokenizer(path: str | None) -> SimTokenizer:
    """One tokenizer per directory per process (several in-process sims share it)."""
    if path is None:
        from gateway.default_tokenizer import default_tokenizer_dir

        path = str(default_tokenizer_dir())
    key = str(Path(path).resolve())
    tok = _TOKENIZERS.get(key)
    if tok is None:
        tok = _TOKENIZERS[key] = SimTokenizer(key)
    return tok


async def start_sim_server(cfg: SimConfig, host: str = "127.0.0.1", port: int = 0) -> RunningSim:
    """Start a simulated replica on the running loop; `await sim.close()` stops it."""
    server = SimServer(cfg, _shared_tokenizer(cfg.tokenizer))
    await server.start(host, port)
    return RunningSim(server, f"http://{host}:{server.port}", server.port)


def main_from_args(args: Any) -> int:
    """`warmroute sim ...`: serve until SIGINT/SIGTERM (also while still starting); 2 when the port
    or a ZMQ endpoint is taken, with a one-line reason."""
    import errno
    import sys

    import zmq

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = config_from_args(args)
    host, port = getattr(args, "host", "127.0.0.1"), getattr(args, "port", 8000)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except NotImplementedError:  # pragma: no cover
                pass
        starting = asyncio.create_task(start_sim_server(cfg, host, port))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # signalled while loading the tokenizer or binding
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return
        stopped.cancel()
        sim = starting.result()
        eng = sim.engine
        log.info("warmroute sim %s on %s: %d blocks of %d tokens, events %s", cfg.model, sim.url, eng.pool.num_blocks, cfg.block_size, cfg.kv_events_endpoint or "off")
        print(f"warmroute sim listening on {sim.url}", flush=True)
        await stop.wait()
        await sim.close()

    try:
        try:
            import uvloop  # type: ignore

            uvloop.run(run())
        except ImportError:
            asyncio.run(run())
    except zmq.ZMQError as exc:
        print(f"warmroute sim: cannot open the KV-event sockets (--kv-events-endpoint {cfg.kv_events_endpoint}, "
              f"--replay-endpoint {cfg.replay_endpoint}): {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        print(f"warmroute sim: cannot listen on {host}:{port} (--port): address already in use", file=sys.stderr)
        return 2
    return 0
