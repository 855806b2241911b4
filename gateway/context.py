"""The per-request record every pipeline stage reads and writes, and the records stages hand on.

Rule: one `RequestContext` per proxied request, created by a front (the HTTP port, or the Envoy
picker) and filled in stage by stage (gateway.pipeline lists the order): each field is written by
one stage and read by the later ones, so a stage's inputs are visible in its signature's
`ctx` and nowhere else. The stage records (`ParsedRequest`, `Prompt`, `Routing`, `Try`,
`Outcome`) are plain data; nothing here does I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Mapping

from gateway.auth import Identity
from gateway.load import Flight
from policies.base import Candidate, Decision, ReplicaView, RequestView

__all__ = ["ParsedRequest", "Prompt", "Routing", "Try", "Outcome", "RequestContext", "CHAT", "COMPLETIONS",
           "RESPONSES"]

CHAT = "chat"
COMPLETIONS = "completions"
RESPONSES = "responses"  # OpenAI's Responses API, rendered by the engine as a chat (gateway.responses_api)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated OpenAI request: what tokenization and the rewrite need (gateway.parse)."""

    kind: str  # CHAT | COMPLETIONS | RESPONSES
    model: str  # the model name the client asked for
    stream: bool  # SSE response
    client_wants_usage: bool  # stream_options.include_usage was set by the client
    max_tokens: int  # max_tokens / max_completion_tokens / max_output_tokens; 0 when not given
    n: int = 1  # choices per prompt (chat, completions): vLLM runs n sequences on the one prompt
    reads_cache: bool = True  # False: the engine skips its prefix cache (prompt logprobs asked: gateway.parse)
    add_special_tokens: bool = False  # the tokenizer adds its BOS/EOS (vLLM's default: completions only)
    truncate: int | None = None  # truncate_prompt_tokens: the engine keeps this many (-1: the context less one)
    truncation_side: str | None = None  # "left" keeps the last tokens, "right" the first (None: the tokenizer's, left)
    messages: list | None = None  # chat: the messages (responses: the chat messages the engine renders)
    add_generation_prompt: bool = True  # chat template option (vLLM default True)
    continue_final_message: bool = False  # chat template option
    chat_template_kwargs: dict | None = None  # extra template variables
    tools: list | None = None  # tools rendered by the template (None when tool_choice drops them)
    prompts: list | None = None  # completions: each prompt (str or token-id list); a batch has several
    previous_response_id: str | None = None  # responses: the stored response it follows (gateway.stored_responses)
    background: bool = False  # responses: run on in the engine after its answer (gateway.background_holds)
    # prompt embeddings (completions' `prompt_embeds`, chat's prompt_embeds parts): the engine keys every
    # block with their hash, so nothing is keyed or predicted here (gateway.encode)
    embeds: bool = False

    @property
    def sequences(self) -> int:
        """The engine requests it makes: vLLM runs each prompt of a batch, and each of `n` choices, as one."""
        return self.n * (len(self.prompts) if self.prompts else 1)


@dataclass(frozen=True, slots=True)
class Prompt:
    """The request's prompt as the engine will count it (gateway.encode)."""

    first_ids: list  # token ids of the (first) prompt: the one routed on
    total_tokens: int  # every prompt's tokens (a completions batch counts them all)
    tokenize_s: float  # seconds spent tokenizing
    last_ids: list | None = None  # a completions batch's last prompt (its usage reports that one's cached tokens)
    last_shared: int = 0  # leading tokens the last prompt shares with an earlier one of its batch
    cut: bool = False  # media parts: the ids end before the first item's placeholder; the engine's prompt is longer
    after_cut: int = 0  # cut: the text tokens after the first item (total_tokens adds them and the items' estimate)
    media_items: int = 0  # cut: the media items the engine's processor puts in

    @property
    def routed_tokens(self) -> int:
        """The routed prompt's tokens as the engine will count them (a cut one: at least one
        placeholder past its ids, so its last full block can be found)."""
        return max(self.total_tokens, len(self.first_ids) + 1) if self.cut else len(self.first_ids)


@dataclass(frozen=True, slots=True)
class Routing:
    """The routing decision and what it was made from (gateway.decide)."""

    request: RequestView  # the request's keys and token counts
    views: tuple[ReplicaView, ...]  # every replica as the decision saw it
    decision: Decision  # the policy's ranking
    decision_s: float  # seconds spent assembling views and ranking

    def view_of(self, replica_id: str) -> ReplicaView | None:
        for v in self.views:
            if v.replica_id == replica_id:
                return v
        return None


@dataclass(slots=True)
class Try:
    """One attempt on one replica (gateway.dispatch)."""

    number: int  # 0 for the first-ranked replica
    candidate: Candidate  # its rank entry (score terms)
    view: ReplicaView | None  # its view at decision time
    predicted_cached_tokens: int | None  # what the index says the engine will report cached (None: not predictable; routing.reported_cached_tokens)
    uncached_tokens: int  # prompt tokens it must prefill (all prompts, minus the predicted hit)
    flight: Flight  # its in-flight accounting; finished by dispatch on every path

    @property
    def replica_id(self) -> str:
        return self.candidate.replica_id


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a finished request tells the learner (gateway.learn); the relay fills it in."""

    replica_id: str  # the replica that served it
    ttft_s: float | None  # upstream send -> first event of a stream; None for a whole answer
    predicted_cached_tokens: int | None  # the index's prediction at dispatch (None: not predictable)
    uncached_tokens: int  # the predicted uncached prompt tokens at dispatch
    backlog_tokens: float  # the queued prefill the policy saw ahead of it
    running_reqs: int  # the running requests the policy saw
    usage: Mapping[str, Any] | None  # the engine's usage object, when it sent one
    decode_step_s: float | None  # mean inter-event interval of the stream; None when too short


@dataclass(slots=True)
class RequestContext:
    """One request through the pipeline; fields in the order the stages fill them."""

    request_id: str  # the client's X-Request-Id when sane, else our own
    route: str  # the API path, e.g. "/v1/chat/completions"
    kind: str  # CHAT | COMPLETIONS | RESPONSES; an engine route's path without "/" (gateway.engine_routes)
    headers: Mapping[str, str]  # the client's request headers
    t0: float  # perf_counter at arrival
    identity: Identity | None = None  # who asked (authenticate)
    payload: dict | None = None  # the JSON body; rewritten in place for the upstream (rewrite)
    request: ParsedRequest | None = None  # the validated request (parse)
    prompt: Prompt | None = None  # token ids (tokenize)
    salt: str = ""  # the derived cache salt (salt)
    lora: str | None = None  # the LoRA adapter the request runs, None: the base model (plan; gateway.model)
    only: Collection[str] | None = None  # the replicas it may go to (a subset hint, its adapter's); None: any (plan)
    keys: list = field(default_factory=list)  # block keys of the first prompt (key)
    history_keys: tuple = ()  # a chat with media: the keys standing for its blocks past the first item (key)
    last_keys: list | None = None  # a completions batch's last prompt's block keys (its usage reports that one)
    routing: Routing | None = None  # the decision (decide)
    body: bytes = b""  # the upstream request body (rewrite)
    engine_priority: int | None = None  # the vLLM priority the body carries (flow.engine_priority; rewrite)
    attempt: Try | None = None  # the attempt under way or the one that answered (dispatch)
    status: int = 500  # the HTTP status the client got (499: it went away first)
    error: str = ""  # the error code when the gateway answered with an error itself
    replica: str = "-"  # the replica that answered (or was tried last)
    span: Any = None  # the request's trace span (gateway.tracing; a no-op span when tracing is off)
    limited: int = 0  # tenant limiter slots held, released at the end (one per engine sequence: TenantLimiter)
    flow: Any = None  # the flow-control ticket (gateway.flow.Ticket; None when flow control is off)
    response_id: str | None = None  # the id the engine stores the response under (gateway.stored_responses); None: not stored
