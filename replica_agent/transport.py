"""Engine KV-event transport: ZMQ SUB + replay DEALER (thin I/O) around a pure sequencer.

Rule (the `Sequencer`, sans-I/O, everything that decides lives there): batches of one engine are
delivered exactly once, in `seq` order, or a `Resync` is emitted saying "what you knew about this
engine may be wrong: drop it and relearn". Inputs are live batches, replayed batches, and the end
(or failure) of a replay; outputs are `Deliver(seq, payload)`, `RequestReplay(start_seq)` and
`Resync(reason)` actions, in the order the caller must perform them.
  - first batch seen with seq > 0, or a jump in seq: ask for a replay from the first missing seq
    and buffer live batches meanwhile; without a replay endpoint: Resync and go on from there;
  - replay: deliver replayed batches with the expected seq, skip older ones; if the first replayed
    seq is above the one asked for, or the replay returns nothing, or it fails/times out, or the
    live buffer overflows: Resync, then deliver what is available from there on;
  - seq going backwards: the engine restarted (its seq starts at 0 again): Resync, then treat the
    batch as the first one of a new engine.
`EngineStream` (the I/O edge) owns the sockets: SUB connects to an engine that binds, or binds
(`bind=True`) for an engine that connects; live messages are `[topic, seq8, payload]` (also
`[seq8, payload]`); replay sends `[b"", seq8]` and reads `[b"", topic, seq8, payload]` or
`[b"", seq8, payload]` until the end marker (seq 0xFF*8).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Union

__all__ = [
    "Deliver", "RequestReplay", "Resync", "Action", "Sequencer", "SequencerStats",
    "EngineStream", "ReplayFailed", "parse_live_frames", "parse_replay_frames", "END_SEQ",
]

log = logging.getLogger("warmroute.agent.transport")

END_SEQ = 0xFFFF_FFFF_FFFF_FFFF
_END = b"\xff" * 8


@dataclass(frozen=True, slots=True)
class Deliver:
    seq: int  # engine batch sequence number
    payload: bytes  # msgpack payload (replica_agent.decode)


@dataclass(frozen=True, slots=True)
class RequestReplay:
    start_seq: int  # first seq to ask the engine's replay socket for


@dataclass(frozen=True, slots=True)
class Resync:
    reason: str  # why the replica's known state must be dropped


Action = Union[Deliver, RequestReplay, Resync]


@dataclass(slots=True)
class SequencerStats:
    delivered: int = 0  # batches delivered
    gaps: int = 0  # jumps in seq seen live (including a late first batch)
    replays: int = 0  # replays requested
    replayed: int = 0  # batches delivered from replays
    resyncs: int = 0  # Resync actions emitted
    restarts: int = 0  # seq went backwards
    duplicates: int = 0  # batches skipped as already delivered
    last_reason: str = ""  # reason of the last Resync


@dataclass(slots=True)
class Sequencer:
    """Ordering, gap detection, replay and resync for one engine (see the module rule)."""

    replay_available: bool  # is there a replay endpoint?
    max_buffered: int = 10_000  # live batches held while a replay runs
    expected: int | None = field(default=None, init=False)  # next seq to deliver; None before the first
    replaying: bool = field(default=False, init=False)  # a replay is under way
    stats: SequencerStats = field(default_factory=SequencerStats, init=False)
    _asked: int = field(default=0, init=False)  # start seq of the replay under way
    _replay_seen: bool = field(default=False, init=False)  # has that replay returned a batch yet
    _buffer: deque = field(default_factory=deque, init=False)  # live batches held during a replay

    # ---------------------------------------------------------------- inputs
    def live(self, seq: int, payload: bytes) -> list[Action]:
        if self.replaying:
            if len(self._buffer) >= self.max_buffered:
                out = self._resync(f"live buffer overflow ({self.max_buffered}) during replay")
                self.replaying = False
                self._buffer.clear()
                self.expected = seq + 1
                return out + [self._deliver(seq, payload)]
            self._buffer.append((seq, payload))
            return []
        if self.expected is not None and seq < self.expected:
            self.stats.restarts += 1
            out = self._resync(f"engine restarted (seq {seq} after {self.expected - 1})")
            self.expected = None
            return out + self._first(seq, payload)
        if self.expected is None:
            return self._first(seq, payload)
        if seq == self.expected:
            self.expected = seq + 1
            return [self._deliver(seq, payload)]
        self.stats.gaps += 1
        return self._gap(self.expected, seq, payload)

    def replayed(self, seq: int, payload: bytes) -> list[Action]:
        if not self.replaying:
            return []  # a late reply from an abandoned replay
        out: list[Action] = []
        if not self._replay_seen:
            self._replay_seen = True
            if seq > self._asked:
                out += self._resync(f"replay starts at {seq}, {self._asked} asked: gap not replayable")
                self.expected = seq
        assert self.expected is not None
        if seq < self.expected:
            self.stats.duplicates += 1
            return out
        if seq > self.expected:
            out += self._resync(f"replay skipped {self.expected}..{seq - 1}")
        self.expected = seq + 1
        self.stats.replayed += 1
        out.append(self._deliver(seq, payload))
        return out

    def replay_done(self) -> list[Action]:
        if not self.replaying:
            return []
        out: list[Action] = []
        if not self._replay_seen:
            out += self._resync(f"replay from {self._asked} returned nothing: gap not replayable")
            self.expected = None
        return out + self._drain()

    def replay_failed(self, reason: str) -> list[Action]:
        if not self.replaying:
            return []
        out = self._resync(f"replay failed: {reason}")
        self.expected = None
        return out + self._drain()

    # ---------------------------------------------------------------- helpers
    def _deliver(self, seq: int, payload: bytes) -> Deliver:
        self.stats.delivered += 1
        return Deliver(seq, payload)

    def _resync(self, reason: str) -> list[Action]:
        self.stats.resyncs += 1
        self.stats.last_reason = reason
        return [Resync(reason)]

    def _first(self, seq: int, payload: bytes) -> list[Action]:
        if seq == 0:
            self.expected = 1
            return [self._deliver(seq, payload)]
        self.stats.gaps += 1
        return self._gap(0, seq, payload)

    def _gap(self, missing_from: int, seq: int, payload: bytes) -> list[Action]:
        if not self.replay_available:
            out = self._resync(f"missed seq {missing_from}..{seq - 1} and no replay endpoint")
            self.expected = seq + 1
            return out + [self._deliver(seq, payload)]
        self.replaying = True
        self._asked = missing_from
        self._replay_seen = False
        self.expected = missing_from
        self._buffer.clear()
        self._buffer.append((seq, payload))
        self.stats.replays += 1
        return [RequestReplay(missing_from)]

    def _drain(self) -> list[Action]:
        self.replaying = False
        out: list[Action] = []
        buf, self._buffer = self._buffer, deque()
        for seq, payload in buf:
            if self.expected is None:
                self.expected = seq + 1
                out.append(self._deliver(seq, payload))
            elif seq < self.expected:
                self.stats.duplicates += 1
            elif seq == self.expected:
                self.expected = seq + 1
                out.append(self._deliver(seq, payload))
            else:
                out += self._resync(f"missed seq {self.expected}..{seq - 1} after replay")
                self.expected = seq + 1
                out.append(self._deliver(seq, payload))
        return out


# -------------------------------------------------------------------- frame parsing (pure)
def parse_live_frames(frames: list[bytes]) -> tuple[str, int, bytes]:
    """[topic, seq8, payload] (or [seq8, payload]) -> (topic, seq, payload)."""
    if len(frames) >= 3:
        topic, seq, payload = frames[-3], frames[-2], frames[-1]
    elif len(frames) == 2:
        topic, (seq, payload) = b"", frames
    else:
        raise ValueError(f"live KV-event message has {len(frames)} frames; expected 3 (or 2)")
    if len(seq) != 8:
        raise ValueError(f"seq frame must be 8 bytes, got {len(seq)}")
    return topic.decode("utf-8", "replace"), int.from_bytes(seq, "big"), payload


def parse_replay_frames(frames: list[bytes]) -> tuple[str, int, bytes] | None:
    """A replay reply -> (topic, seq, payload), or None for the end marker."""
    f = frames[1:] if frames and frames[0] == b"" else frames
    if len(f) >= 3:
        topic, seq, payload = f[-3], f[-2], f[-1]
    elif len(f) == 2:
        topic, (seq, payload) = b"", f
    else:
        raise ValueError(f"replay reply has {len(frames)} frames")
    if seq == _END:
        return None
    if len(seq) != 8:
        raise ValueError(f"replay seq frame must be 8 bytes, got {len(seq)}")
    return topic.decode("utf-8", "replace"), int.from_bytes(seq, "big"), payload


class ReplayFailed(RuntimeError):
    pass


# -------------------------------------------------------------------- the I/O edge
class EngineStream:
    """Async iterator of `Deliver` / `Resync` for one engine (replays done inside)."""

    def __init__(self, endpoint: str, *, bind: bool = False, replay_endpoint: str | None = None,
                 topic: str = "", replay_timeout_s: float = 5.0, ctx=None) -> None:
        import zmq
        import zmq.asyncio

        self.endpoint = endpoint
        self.bind = bind
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.seq = Sequencer(replay_available=replay_endpoint is not None)
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.asyncio.Context()
        self._zmq = zmq
        self._sub = None
        self.bad_frames = 0

    def open(self) -> None:
        zmq = self._zmq
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        try:
            if self.bind:
                sub.bind(self.endpoint)
            else:
                sub.connect(self.endpoint)
        except BaseException:  # e.g. the endpoint is in use: an open socket would block close()'s term()
            sub.close(0)
            raise
        self._sub = sub

    def close(self) -> None:
        if self._sub is not None:
            self._sub.close(0)
            self._sub = None
        if self._own_ctx:
            self._ctx.term()

    async def _replay(self, start_seq: int) -> AsyncIterator[tuple[int, bytes]]:
        zmq = self._zmq
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(int(self.replay_timeout_s * 1000)):
                    raise ReplayFailed(f"no reply from {self.replay_endpoint} within {self.replay_timeout_s}s")
                parsed = parse_replay_frames(await dealer.recv_multipart())
                if parsed is None:
                    return
                yield parsed[1], parsed[2]
        finally:
            dealer.close(0)

    async def __aiter__(self) -> AsyncIterator[Deliver | Resync]:
        if self._sub is None:
            self.open()
        while True:
            frames = await self._sub.recv_multipart()
            try:
                _, seq, payload = parse_live_frames(frames)
            except ValueError as exc:
                self.bad_frames += 1
                log.warning("bad live frame: %s", exc)
                continue
            pending = self.seq.live(seq, payload)
            while pending:
                act = pending.pop(0)
                if isinstance(act, RequestReplay):
                    pending = await self._do_replay(act.start_seq) + pending
                else:
                    yield act

    async def _do_replay(self, start_seq: int) -> list[Action]:
        """Run one replay, feeding live batches that arrive meanwhile into the sequencer."""
        out: list[Action] = []
        agen = self._replay(start_seq)
        try:
            async for seq, payload in agen:
                out += self.seq.replayed(seq, payload)
                out += await self._poll_live_nowait()
        except ReplayFailed as exc:
            out += await self._poll_live_nowait()
            return out + self.seq.replay_failed(str(exc))
        except ValueError as exc:
            return out + self.seq.replay_failed(f"bad replay frame: {exc}")
        finally:
            await agen.aclose()
        out += await self._poll_live_nowait()
        return out + self.seq.replay_done()

    async def _poll_live_nowait(self) -> list[Action]:
        out: list[Action] = []
        while await self._sub.poll(0):
            frames = await self._sub.recv_multipart()
            try:
                _, seq, payload = parse_live_frames(frames)
            except ValueError:
                self.bad_frames += 1
                continue
            out += self.seq.live(seq, payload)
        return out
