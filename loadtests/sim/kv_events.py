"""KV-cache events on the wire, as vLLM's ZmqEventPublisher sends them (vLLM 0.32).

Encoding (pure, `encode_batch`): msgpack `[ts, [event, ...], data_parallel_rank]`; events as maps
with "type" first (current format) or, with events_format="array", the older positional arrays
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name, extra_keys]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`.
Hashes are the last 8 bytes of each digest as u64 ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).

Transport (`KVEventPublisher`): a PUB socket that binds when the endpoint has `*` or `::` or is
ipc/inproc and connects otherwise; 3 frames `[topic, seq 8-byte BE, payload]`, seq from 0 per
process (per `reset()`), +1 per batch. A ROUTER replay socket (always binds) keeps the last
`buffer_steps` batches: a request `[identity, b"", start_seq8]` gets `[identity, b"", topic, seq8,
payload]` for each retained batch with seq >= start, then `[identity, b"", b"", 0xFF*8, b""]`.
Fault: `drop_fraction` skips publishing a batch but still consumes its seq, exactly as a PUB drop
looks to a subscriber (a seq gap); a dropped batch is not kept for replay either.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from typing import Iterable

import msgspec
import zmq
import zmq.asyncio

from hashing.vllm_hash import event_int
from loadtests.sim.blockpool import AllBlocksCleared, BlockRemoved, BlockStored, PoolEvent

__all__ = ["encode_event", "encode_batch", "endpoint_binds", "KVEventPublisher", "END_SEQ"]

END_SEQ = b"\xff" * 8
_enc = msgspec.msgpack.Encoder()


def endpoint_binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: bind for wildcard hosts and ipc/inproc, else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def encode_event(ev: PoolEvent, events_format: str = "map") -> dict | list:
    if isinstance(ev, BlockStored):
        hashes = [event_int(h) for h in ev.block_hashes]
        parent = event_int(ev.parent_block_hash) if ev.parent_block_hash is not None else None
        if events_format == "array":
            return ["BlockStored", hashes, parent, ev.token_ids, ev.block_size, None, ev.medium, ev.lora_name, ev.extra_keys]
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": ev.token_ids,
            "block_size": ev.block_size,
            "lora_id": None,
            "medium": ev.medium,
            "lora_name": ev.lora_name,
            "extra_keys": ev.extra_keys,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    if isinstance(ev, BlockRemoved):
        hashes = [event_int(h) for h in ev.block_hashes]
        if events_format == "array":
            return ["BlockRemoved", hashes, ev.medium]
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": ev.medium, "group_idx": 0}
    if isinstance(ev, AllBlocksCleared):
        return ["AllBlocksCleared"] if events_format == "array" else {"type": "AllBlocksCleared"}
    raise TypeError(f"not a pool event: {ev!r}")


def encode_batch(events: Iterable[PoolEvent], ts: float | None = None, data_parallel_rank: int = 0, events_format: str = "map") -> bytes:
    """The msgpack payload of one batch."""
    return _enc.encode([time.time() if ts is None else ts, [encode_event(e, events_format) for e in events], data_parallel_rank])


class KVEventPublisher:
    """PUB + optional ROUTER replay for one simulated engine. Create and use it on one event loop;
    `publish` is synchronous and never blocks (PUB drops at the high-water mark)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10000,
        hwm: int = 100000,
        events_format: str = "map",
        data_parallel_rank: int = 0,
        seed: int = 0,
    ) -> None:
        if events_format not in ("map", "array"):
            raise ValueError(f"events_format must be 'map' or 'array', got {events_format!r}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._topic_b = topic.encode("utf-8")
        self.events_format = events_format
        self.data_parallel_rank = data_parallel_rank
        self.drop_fraction = 0.0  # fault: share of batches skipped (their seq is consumed)
        self._rng = random.Random(seed)
        self.seq = 0  # next seq to use
        self.num_published = 0
        self.num_dropped = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._actx: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task | None = None
        try:
            if endpoint_binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint:
                self._actx = zmq.asyncio.Context()
                self._router = self._actx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(replay_endpoint)
        except BaseException:  # e.g. an endpoint in use: close what was opened, or term() blocks at exit
            if self._router is not None:
                self._router.close(0)
            if self._actx is not None:
                self._actx.term()
            self._pub.close(0)
            self._ctx.term()
            raise

    @property
    def pub_last_endpoint(self) -> str:
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self) -> None:
        """Start serving replay requests (needs a running event loop)."""
        loop = asyncio.get_running_loop()
        if self._router is not None and self._replay_task is None:
            self._replay_task = loop.create_task(self._serve_replay())

    def publish(self, events: list[PoolEvent]) -> int | None:
        """Send one batch; returns its seq (None for an empty batch, which sends nothing)."""
        if not events:
            return None
        seq = self.seq
        self.seq += 1
        if self.drop_fraction > 0 and self._rng.random() < self.drop_fraction:
            self.num_dropped += 1
            return seq
        payload = encode_batch(events, None, self.data_parallel_rank, self.events_format)
        seq8 = seq.to_bytes(8, "big")
        try:
            self._pub.send_multipart((self._topic_b, seq8, payload), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # a connect-mode PUB with no peer yet: vLLM drops too
            pass
        self._buffer.append((seq, payload))
        self.num_published += 1
        return seq

    def reset(self) -> None:
        """A process restart: seq back to 0, replay buffer emptied."""
        self.seq = 0
        self._buffer.clear()

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            try:
                frames = await router.recv_multipart()
            except (asyncio.CancelledError, zmq.ContextTerminated):
                return
            except zmq.ZMQError:
                return
            if len(frames) < 3:
                continue
            ident, start8 = frames[0], frames[-1]
            try:
                start = int.from_bytes(start8, "big")
            except Exception:  # noqa: BLE001
                continue
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart([ident, b"", self._topic_b, seq.to_bytes(8, "big"), payload])
            await router.send_multipart([ident, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            try:
                await self._replay_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._replay_task = None
        if self._router is not None:
            self._router.close(0)
        if self._actx is not None:
            self._actx.term()
        self._pub.close(0)
        self._ctx.term()
