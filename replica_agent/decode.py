"""Decode a vLLM KV-event payload (msgpack bytes) into typed events (pure; vLLM's wire format).

Rule: the payload is `[ts, [event, ...], data_parallel_rank?]`; each event is either a map with
"type" first (current format) or a positional array `["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys?, ...]` /
`["BlockRemoved", block_hashes, medium?, ...]` / `["AllBlocksCleared", ...]` (engines up to ~v0.23).
Unknown map keys and extra positional fields are ignored; an unknown event type is skipped and
counted (`EventBatch.skipped`), so a newer engine never stops the agent. Hash values stay opaque
`EngineHash`es: u64 ints (values >= 2**63 occur) or raw digest bytes, never reinterpreted.
A payload that is not msgpack, or not that top-level shape, raises `EngineDecodeError`
(the engine's fault; the caller counts it and moves on).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import msgspec

from hashing.keys import EngineHash

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EngineDecodeError", "EventBatch", "KVEvent", "decode_payload"]


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[EngineHash, ...]  # one per full block of the run, in chain order
    parent_block_hash: EngineHash | None  # hash of the block before the run; None: run starts at block 0
    token_ids: tuple[int, ...]  # all tokens of those blocks, concatenated
    block_size: int  # tokens per block (0 if the event did not say)
    medium: str  # "GPU" | "CPU" | "STORAGE" ... ("GPU" if absent)
    lora_name: str | None  # LoRA adapter name, None for the base model
    extra_keys: tuple[Any, ...] | None  # one entry per block: None or a tuple of items; None if absent


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]  # evicted blocks
    medium: str  # tier they were evicted from ("GPU" if absent)


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float  # engine wall-clock time of the batch (s since the epoch)
    events: tuple[KVEvent, ...]  # in engine order
    data_parallel_rank: int  # 0 when absent
    skipped: int = 0  # events of unknown type or shape that were ignored


class EngineDecodeError(ValueError):
    """The engine sent a payload this decoder cannot read (not msgpack, or not [ts, [events], rank])."""


_decoder = msgspec.msgpack.Decoder()
_CLEARED = AllBlocksCleared()


def _hash(v: Any) -> EngineHash:
    if isinstance(v, (int, bytes)):
        return EngineHash(v)
    if isinstance(v, (bytearray, memoryview)):
        return EngineHash(bytes(v))
    if isinstance(v, list):  # some encoders emit digests as int arrays
        return EngineHash(bytes(v))
    raise TypeError(f"block hash of unexpected type {type(v).__name__}")


def _hashes(v: Any) -> tuple[EngineHash, ...]:
    if v is None:
        return ()
    return tuple(x if type(x) is int else _hash(x) for x in v)


def _freeze(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((str(k), _freeze(x)) for k, x in v.items()))
    return v


def _extra_keys(v: Any) -> tuple[Any, ...] | None:
    if v is None:
        return None
    return tuple(None if x is None else _freeze(x) if isinstance(x, list) else (x,) for x in v)


def _stored(block_hashes, parent, token_ids, block_size, medium, lora_name, extra_keys) -> BlockStored:
    return BlockStored(
        block_hashes=_hashes(block_hashes),
        parent_block_hash=None if parent is None else _hash(parent),
        token_ids=tuple(token_ids or ()),
        block_size=int(block_size or 0),
        medium=str(medium) if medium else "GPU",
        lora_name=str(lora_name) if lora_name else None,
        extra_keys=_extra_keys(extra_keys),
    )


def _from_map(e: dict) -> KVEvent | None:
    t = e.get("type")
    if t == "BlockStored":
        return _stored(e.get("block_hashes"), e.get("parent_block_hash"), e.get("token_ids"), e.get("block_size"),
                       e.get("medium"), e.get("lora_name"), e.get("extra_keys"))
    if t == "BlockRemoved":
        return BlockRemoved(_hashes(e.get("block_hashes")), str(e.get("medium") or "GPU"))
    if t == "AllBlocksCleared":
        return _CLEARED
    return None


def _from_array(e: list) -> KVEvent | None:
    t = e[0] if e else None
    n = len(e)
    if t == "BlockStored":
        if n < 5:
            return None
        return _stored(e[1], e[2], e[3], e[4], e[6] if n > 6 else None, e[7] if n > 7 else None, e[8] if n > 8 else None)
    if t == "BlockRemoved":
        if n < 2:
            return None
        return BlockRemoved(_hashes(e[1]), str(e[2]) if n > 2 and e[2] else "GPU")
    if t == "AllBlocksCleared":
        return _CLEARED
    return None


def decode_payload(payload: bytes) -> EventBatch:
    """Typed events of one ZMQ payload, in order (see the module rule)."""
    try:
        top = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise EngineDecodeError(f"KV-event payload is not msgpack: {exc}") from exc
    if not isinstance(top, list) or len(top) < 2 or not isinstance(top[1], list):
        raise EngineDecodeError(f"KV-event payload is not [ts, [events], rank]: got {type(top).__name__}")
    ts = float(top[0]) if isinstance(top[0], (int, float)) else 0.0
    rank = top[2] if len(top) > 2 and isinstance(top[2], int) else 0
    out: list[KVEvent] = []
    skipped = 0
    for raw in top[1]:
        try:
            if isinstance(raw, dict):
                ev = _from_map(raw)
            elif isinstance(raw, list):
                ev = _from_array(raw)
            else:
                ev = None
        except (TypeError, ValueError):
            ev = None
        if ev is None:
            skipped += 1
        else:
            out.append(ev)
    return EventBatch(ts, tuple(out), rank, skipped)
