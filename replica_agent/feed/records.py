"""Feed records (a contract between agents and gateways): what flows from a replica agent to every gateway.

Rule: per replica, an ordered stream of `FeedEvent`s whose `offset` grows by exactly 1 per record
(dense, assigned by the feed on publish, continuing after the feed's last offset for that replica;
an empty stream starts at `fresh_stream_base()`, a time-derived number, so offsets of a wiped and
restarted stream never repeat old ones and a consumer sees the wipe as a jump), plus
a `Snapshot`: the replica's full key set per medium, valid *after* applying every record with
offset <= `Snapshot.offset`. A consumer rebuilds with `load_snapshot` and then applies records with
offset > `Snapshot.offset`; a jump in offsets (trimmed stream) or an offset that goes backwards (feed
wiped) means "rebuild from the snapshot again". Keys are warmroute block keys (hashing/keys.py),
unsigned 64-bit ints; never engine hashes.

Kinds: "stored" / "removed" (keys on one medium), "cleared" (the replica dropped everything, every
medium), "load" (a `LoadReport`; without one it is a heartbeat: the agent is alive), "hello" (an
agent (re)started, or learnt its block size: block size, model, epoch).

This module is pure data plus a compact msgpack codec used by out-of-process transports.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

__all__ = [
    "KINDS",
    "INVALID_KIND",
    "MEDIUM_GPU",
    "MEDIUM_CPU",
    "FeedEvent",
    "Hello",
    "LoadReport",
    "Snapshot",
    "Inflight",
    "encode_event",
    "decode_event",
    "encode_snapshot",
    "decode_snapshot",
    "FeedDecodeError",
    "fresh_stream_base",
]

KINDS = ("stored", "removed", "cleared", "load", "hello")
# kind of a record a transport could not decode: it keeps its offset so the stream stays dense;
# consumers skip it and count it (never produced by publishers)
INVALID_KIND = "invalid"
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


@dataclass(frozen=True, slots=True)
class LoadReport:
    """One scrape of the engine's /metrics, as the agent saw it."""

    running_reqs: int  # vllm:num_requests_running
    waiting_reqs: int  # vllm:num_requests_waiting
    kv_usage: float  # vllm:kv_cache_usage_perc, a fraction 0..1
    prefix_cache_queries_total: float  # vllm:prefix_cache_queries_total (tokens, counter)
    prefix_cache_hits_total: float  # vllm:prefix_cache_hits_total (tokens, counter)
    num_gpu_blocks: int  # vllm:cache_config_info{num_gpu_blocks}; 0 when unknown
    block_size: int  # vllm:cache_config_info{block_size}; 0 when unknown
    ts: float  # wall-clock time of the scrape (s since the epoch)
    # vllm:lora_requests_info, its newest series (engines started with --enable-lora only):
    max_lora: int = 0  # LoRA slots of one batch (--max-loras); 0: unknown, or LoRA off
    lora_running: tuple[str, ...] = ()  # adapters with a running request (each holds a slot)
    lora_waiting: tuple[str, ...] = ()  # adapters with a waiting request


@dataclass(frozen=True, slots=True)
class Hello:
    """An agent announcing itself; a new `agent_epoch` means a new agent process."""

    block_size: int  # tokens per block, as the engine reports it
    model: str  # served model name (the key root is derived from it)
    agent_epoch: str  # unique per agent process start


@dataclass(frozen=True, slots=True)
class FeedEvent:
    """One record of a replica's stream."""

    replica_id: str  # the replica, as the gateway names it
    offset: int  # position in that replica's stream, dense and increasing
    kind: str  # stored|removed|cleared|load|hello
    keys: tuple[int, ...] = ()  # warmroute block keys (stored/removed only)
    medium: str = MEDIUM_GPU  # "GPU" | "CPU" | other engine tiers (stored/removed only)
    load: LoadReport | None = None  # kind == "load"
    hello: Hello | None = None  # kind == "hello"
    ts: float = 0.0  # wall-clock time the agent published it (s since the epoch); 0 = unknown


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The replica's full key set per medium, valid after applying every record <= offset."""

    replica_id: str  # the replica
    offset: int  # stream offset the set is valid at (0: before any record)
    keys_by_medium: dict[str, tuple[int, ...]] = field(default_factory=dict)  # medium -> keys
    ts: float = 0.0  # wall-clock time it was taken (s since the epoch)


@dataclass(frozen=True, slots=True)
class Inflight:
    """Work that gateways have sent a replica and not yet seen finish (shared across gateways)."""

    reqs: int  # requests in flight (sent, no first token yet)
    prefill_tokens: int  # their uncached prompt tokens
    open_reqs: int = 0  # requests sent and not finished (in flight or decoding): sequence slots they hold
    # dispatch gauges, each gateway's own replaced at every exchange and summed here (gateway.load):
    routed_rps: float = 0.0  # requests routed here per second
    size_weight: float = 0.0  # by-age weight of the requests in their mean uncached tokens
    size_tokens: float = 0.0  # that weight x that mean
    # the other gateways' LoRA adapters with requests here (each gateway's own replaced at every
    # exchange; the reader's own left out): generating, so holding a slot; no first token yet
    lora_running: tuple[str, ...] = ()
    lora_wanting: tuple[str, ...] = ()


def merge_adapters(published) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Several gateways' LoRA adapters (each a mapping replica -> (running, wanting)) merged per
    replica, names sorted (the gateways' order is the feed's, which need not be stable): running if
    any gateway's request there generates; wanting otherwise. Names that are not strings are
    dropped (another version's, or a damaged entry)."""
    acc: dict[str, tuple[dict, dict]] = {}
    for per in published:
        for rid, (running, wanting) in per.items():
            run, want = acc.setdefault(rid, ({}, {}))
            run.update((a, None) for a in running if isinstance(a, str))
            want.update((a, None) for a in wanting if isinstance(a, str))
    return {rid: (tuple(sorted(run)), tuple(sorted(a for a in want if a not in run)))
            for rid, (run, want) in acc.items() if run or want}


def fresh_stream_base() -> int:
    """First offset minus one for a stream the feed holds nothing of: microseconds since the epoch."""
    return time.time_ns() // 1000


class FeedDecodeError(ValueError):
    """A stored feed record could not be decoded (the writer's fault, not the reader's)."""


# Wire form (msgpack array, compact and versioned by position; trailing extra elements are ignored):
#   [kind, keys(list[u64]), medium, load(list|nil), hello(list|nil), ts, lora(list|nil)?]
# `lora` ([max_lora, running, waiting], a load record of an engine serving LoRA only) came after
# the rest: a gateway that predates it ignores it, and records without it decode as before.
# Decoding goes through a typed msgspec decoder (`_Wire`, array_like): msgspec checks the shapes and
# builds the key tuple in C instead of unpacking a generic list and converting each field in Python
# (a gateway decodes every record of every replica; loadtests/bench_feed.py measures it).
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


class _Wire(msgspec.Struct, array_like=True):
    kind: str
    keys: tuple[int, ...]
    medium: str
    load: tuple[int, int, float, float, float, int, int, float] | None
    hello: tuple[int, str, str] | None
    ts: float
    lora: tuple[int, tuple[str, ...], tuple[str, ...]] | None = None


_wire_dec = msgspec.msgpack.Decoder(_Wire)
_KINDS = frozenset(KINDS)


def encode_event(ev: FeedEvent) -> bytes:
    """Bytes of one record without replica_id and offset (the transport stores those)."""
    lr = ev.load
    load = None if lr is None else [lr.running_reqs, lr.waiting_reqs, lr.kv_usage, lr.prefix_cache_queries_total,
                                    lr.prefix_cache_hits_total, lr.num_gpu_blocks, lr.block_size, lr.ts]
    hello = None if ev.hello is None else [ev.hello.block_size, ev.hello.model, ev.hello.agent_epoch]
    record = [ev.kind, list(ev.keys), ev.medium, load, hello, ev.ts]
    if lr is not None and lr.max_lora:  # the trailing LoRA slots: only an engine serving LoRA has them
        record.append([lr.max_lora, list(lr.lora_running), list(lr.lora_waiting)])
    return _enc.encode(record)


def decode_event(replica_id: str, offset: int, data: bytes) -> FeedEvent:
    """Inverse of `encode_event`; raises FeedDecodeError on anything malformed."""
    try:
        w = _wire_dec.decode(data)
    except (msgspec.DecodeError, TypeError) as exc:  # malformed bytes, wrong shapes or types
        raise FeedDecodeError(f"bad feed record for {replica_id}@{offset}: {exc}") from exc
    if w.kind not in _KINDS:
        raise FeedDecodeError(f"unknown feed record kind {w.kind!r}")
    load = None if w.load is None else LoadReport(*w.load) if w.lora is None else LoadReport(*w.load, *w.lora)
    hello = None if w.hello is None else Hello(*w.hello)
    return FeedEvent(replica_id, int(offset), w.kind, w.keys, w.medium, load, hello, w.ts)  # positional: cheaper


def encode_snapshot(snap: Snapshot) -> bytes:
    return _enc.encode([snap.replica_id, snap.offset, {m: list(k) for m, k in snap.keys_by_medium.items()}, snap.ts])


def decode_snapshot(data: bytes) -> Snapshot:
    try:
        rid, offset, kbm, ts = _dec.decode(data)[:4]
        return Snapshot(str(rid), int(offset), {str(m): tuple(k) for m, k in kbm.items()}, float(ts))
    except Exception as exc:
        raise FeedDecodeError(f"bad feed snapshot: {exc}") from exc
