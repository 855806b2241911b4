"""The policy interface: one small Protocol, plain frozen records in and out, no I/O.

A policy ranks the candidate replicas for one request. Input: a `RequestView` (the request's block
keys and token counts) and one `ReplicaView` per replica (match length per medium, load, rates,
health), all plain data assembled by the gateway or the virtual-time simulator. Output: a
`Decision` whose `ranked` tuple lists every *eligible* replica best-first, each `Candidate`
carrying the terms of its score so a trace or the debug route can explain the choice.

Rules every policy keeps (tests/test_policies_conformance.py checks them for all policies):
- an unhealthy replica is never ranked; with no healthy replica `ranked` is empty (the caller
  answers 503), never an exception;
- ranking is deterministic for a given `rng` state;
- `rank` has no side effects on its inputs; a policy may keep its own small state (round-robin's
  cursor) and may learn in the `placed` hook (the request was sent as its decision ranks it: once
  per request, while `rank` may run more than once for one request or for none sent, as flow
  control's late binding and /debug/route do) and the `observe` hook (its outcome); both default
  to doing nothing.
- a policy whose state should span several gateways (cache_plan's plan) returns from `placed` a
  small JSON-able record of the placement and applies the other gateways' records in
  `placed_elsewhere` (`shares_placements` True); the gateway trades them through the feed. Others
  return None and ignore them.
Units live in names: `*_tokens`, `*_blocks`, `*_s`, `*_reqs`.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Mapping, Protocol, Sequence, runtime_checkable

__all__ = ["RequestView", "ReplicaView", "Candidate", "Decision", "Policy", "PolicyBase"]


@dataclass(frozen=True, slots=True)
class RequestView:
    """One request's routing inputs."""

    prompt_tokens: int  # tokens of the prompt as the engine will count them
    block_size: int  # tokens per KV block (only full blocks are keyed/cached)
    keys: tuple[int, ...] = ()  # warmroute block keys of the prompt's full blocks, block 0 first
    max_output_tokens: int = 0  # the request's max_tokens (0: unknown)
    tenant_hash: str = ""  # hashed tenant id ("" when auth is off); never the raw id
    request_id: str = ""  # for logs/traces only
    lora: str | None = None  # the LoRA adapter the request runs (None: the base model)


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the gateway knows of one replica at decision time (read-only)."""

    replica_id: str
    healthy: bool = True  # passes probes and is not ejected
    matched_blocks_gpu: int = 0  # leading run of the request's keys held in GPU KV
    matched_blocks_cpu: int = 0  # leading run counting GPU *or* CPU-offload blocks (>= gpu run)
    index_live: bool = True  # the replica's feed is current; when False its matches are ignored
    running_reqs: int = 0  # engine-reported running requests (agent's last scrape)
    waiting_reqs: int = 0  # engine-reported waiting requests
    inflight_reqs: int = 0  # requests gateways sent it that have not yet produced a first token
    inflight_prefill_tokens: int = 0  # uncached prompt tokens of those in-flight requests
    kv_usage: float = 0.0  # engine-reported KV cache usage, 0..1
    prefill_s_per_token: float = 5e-5  # calibrated (or prior) prefill seconds per uncached token
    decode_step_s: float = 0.02  # calibrated (or prior) seconds per decode step
    kv_capacity_blocks: int = 0  # the engine's KV blocks (vllm:cache_config_info num_gpu_blocks); 0: unknown
    kv_cached_frac: float | None = None  # share of its KV blocks holding indexed prefixes, 0..1 (None: unknown)
    mean_uncached_prefill_tokens: float | None = None  # moving mean of the uncached prompt tokens of requests sent there (None: none yet)
    mean_output_tokens: float | None = None  # moving mean of the max_tokens of requests sent there (None: none gave one)
    routed_rps: float | None = None  # requests the gateway routed there per second, a moving mean (None: not tracked)
    others_routed_rps: float = 0.0  # of those, the other gateways' (as of the last exchange; 0: none known)
    max_lora: int = 0  # the engine's LoRA slots per batch (vLLM --max-loras); 0: unknown, or LoRA off
    lora_running: tuple[str, ...] = ()  # adapters holding those slots (engine-reported, plus the gateways' since)
    lora_waiting: tuple[str, ...] = ()  # other adapters with requests there wanting a slot (the same sources)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One ranked replica with its score and the terms that make it up."""

    replica_id: str
    score: float  # higher is better
    terms: Mapping[str, float]  # e.g. matched_tokens, cache_benefit_s, queue_penalty_s


@dataclass(frozen=True, slots=True)
class Decision:
    policy: str
    ranked: tuple[Candidate, ...]  # eligible replicas, best first; empty when none is eligible

    @property
    def winner(self) -> str | None:
        return self.ranked[0].replica_id if self.ranked else None


@runtime_checkable
class Policy(Protocol):
    name: ClassVar[str]

    def rank(self, request: RequestView, replicas: Sequence[ReplicaView], rng: random.Random) -> Decision:
        """Rank the healthy replicas for `request`; see the module rules."""
        ...

    def placed(self, request: RequestView, decision: Decision) -> list | None:
        """Lifecycle hook: `request` was sent to `decision`'s first candidate (default: ignore).
        Returns the record the other gateways' instances should apply, or None."""
        ...

    def placed_elsewhere(self, record: list) -> None:
        """Lifecycle hook: another gateway's `placed` returned `record` (default: ignore)."""
        ...

    def observe(self, replica_id: str, ttft_s: float, uncached_tokens: int) -> None:
        """Lifecycle hook: the outcome of a request routed by this policy (default: ignore)."""
        ...


class PolicyBase:
    """Convenience base with the no-op hooks."""

    name: ClassVar[str] = "base"
    shares_placements: ClassVar[bool] = False  # placed() returns records for the other gateways

    def placed(self, request: RequestView, decision: Decision) -> list | None:
        return None

    def placed_elsewhere(self, record: list) -> None:
        return None

    def observe(self, replica_id: str, ttft_s: float, uncached_tokens: int) -> None:
        return None
