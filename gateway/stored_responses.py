"""Stored Responses: which replica holds each response an engine stored, and the history a
follow-up renders (on when `responses.store` says the engines store responses: vLLM run with
VLLM_ENABLE_RESPONSES_API_STORE=1).

vLLM keeps a stored response, and the messages it was rendered from, in the memory of the one
engine that answered it; a request naming it (`previous_response_id`, `GET /v1/responses/{id}`,
`POST /v1/responses/{id}/cancel`) can only be served there, and renders the stored history
before its own input (gateway.responses_api). Rules:
- The gateway names every stored response itself: it sets the engine's `request_id` (the
  response's id) to a fresh `resp_<32 hex>`, whatever the client sent, so no tenant can choose an
  id another holds. Before a stored response's first byte reaches the client, its record is
  written: the replica, the owner (the tenant's hash), the response it follows, and its own
  input's messages bar the system ones; the answer's text parts are added when the answer is
  whole (from the relayed body or the stream's last event). A record the answer never reached
  (a background response, an answer relayed by Envoy) gets it from the holder
  (`GET /v1/responses/{id}`) when a follow-up needs it, and shares it once final.
- A follow-up is routed to its previous response's replica only (unavailable: 503), rendered with
  the whole chain's history, so its tokens, keys and prediction are the engine's. A response not
  recorded, expired (`responses.ttl_s`), whose history is no longer whole, or owned by another
  tenant is 404 `response_not_found`, as vLLM says of a response it does not hold; its replica
  gone from the pool, the same (the engine's store went with it).
- A replica that answers 404 for a response it was recorded to hold has lost it (restarted), or
  does not store responses (run without VLLM_ENABLE_RESPONSES_API_STORE=1): counted
  (`engine_lost`), and a warning saying so, at most once a minute per replica.
- Records live in this process (the `responses.max_turns` most recently used) and in the feed
  (replica_agent.feed.stored_turns: Redis, so every gateway process and pod finds them); the feed
  unreachable when a record is not here: 503, and the write of a new record is skipped (counted,
  logged; a follow-up to that response through another gateway is then 404).
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable
from urllib.parse import quote

import aiohttp
import msgspec

from gateway.errors import ApiError
from gateway.responses_api import output_messages
from replica_agent.feed import StoredTurnBoard

__all__ = ["Turn", "StoredResponses", "MAX_DEPTH", "final_output", "fetcher", "not_found", "lost_response"]

log = logging.getLogger("warmroute.gateway.stored_responses")

MAX_DEPTH = 10_000  # turns of one conversation followed at most
LOST_WARNING_EVERY_S = 60.0  # a replica's "lost a stored response" warning at most this often
READ_TIMEOUT_S = 1.0  # a feed read slower than this counts as the feed unreachable
# a record's write, which the answer's first byte waits for, given up after this (the feed unreachable)
WRITE_TIMEOUT_S = 0.25
FINAL = ("completed", "incomplete", "failed", "cancelled")  # a response's statuses after which its output holds

Fetch = Callable[[str, str], Awaitable[dict | None]]  # (replica id, response id) -> the stored response, or None


@dataclass(slots=True)
class Turn:
    """One stored response's record (module rules)."""

    replica_id: str
    owner: str  # the tenant's hash
    previous: str | None  # the response it follows
    said: list  # its input's messages bar the system ones
    answer: list | None = None  # its output as the next turn's assistant messages; None: not known here yet


_encoder = msgspec.msgpack.Encoder()


def _encode(t: Turn) -> bytes:
    return _encoder.encode([t.replica_id, t.owner, t.said, t.answer])


def _decode(previous: str | None, raw: bytes) -> Turn | None:
    try:
        replica_id, owner, said, answer = msgspec.msgpack.decode(raw)
    except (msgspec.DecodeError, TypeError, ValueError):
        return None
    return Turn(replica_id, owner, previous, said, answer)


def final_output(response: object) -> list | None:
    """A response object's output as history, when its status says it is final; else None."""
    if not isinstance(response, dict) or response.get("status") not in FINAL:
        return None
    return output_messages(response.get("output"))


class StoredResponses:
    """The records and the history of follow-ups (module rules)."""

    def __init__(self, board: StoredTurnBoard | None, fetch: Fetch, *, max_turns: int, metrics=None) -> None:
        self.board = board  # None: this process's records only (an in-memory feed of one gateway)
        self.fetch = fetch  # asks a replica for a stored response (its answer, when not known here)
        self.max_turns = max_turns
        self.metrics = metrics  # gateway.telemetry.Metrics (stored_responses counter); None: not counted
        self._turns: OrderedDict[str, Turn] = OrderedDict()
        self._writes: set[asyncio.Task] = set()
        self._warned: dict[str, float] = {}  # replica -> when its last "lost" warning was logged (monotonic)

    @staticmethod
    def new_id() -> str:
        return f"resp_{uuid.uuid4().hex}"

    def count(self, event: str) -> None:
        if self.metrics is not None:
            self.metrics.stored_responses.labels(event).inc()

    def _keep(self, response_id: str, turn: Turn) -> None:
        self._turns[response_id] = turn
        self._turns.move_to_end(response_id)
        while len(self._turns) > self.max_turns:
            self._turns.popitem(last=False)

    async def record(self, response_id: str, turn: Turn) -> None:
        """A stored response's record, written before its answer goes out (module rules)."""
        self._keep(response_id, turn)
        self.count("recorded")
        await self._write(response_id, turn, refresh=True)

    def answered(self, response_id: str, response: object) -> None:
        """The answer of a recorded response (its response object), when whole; written in the background."""
        turn = self._turns.get(response_id)
        answer = final_output(response)
        if turn is None or answer is None or turn.answer == answer:
            return
        turn.answer = answer
        self._write_later(response_id, turn)

    def engine_lost(self, replica_id: str, now: float) -> None:
        """`replica_id` answered 404 for a response recorded on it (module rules)."""
        self.count("engine_lost")
        if now - self._warned.get(replica_id, -LOST_WARNING_EVERY_S) >= LOST_WARNING_EVERY_S:
            self._warned[replica_id] = now
            log.warning("replica %s does not hold a response it stored: it restarted since, or runs without "
                        "VLLM_ENABLE_RESPONSES_API_STORE=1 (responses.store says the engines store responses)",
                        replica_id, extra={"fields": {"replica": replica_id}})

    def moved(self, response_id: str, replica_id: str) -> None:
        """A recorded response was answered by another replica than recorded (a proxy's retry)."""
        turn = self._turns.get(response_id)
        if turn is not None and turn.replica_id != replica_id:
            turn.replica_id = replica_id
            self._write_later(response_id, turn)

    def _write_later(self, response_id: str, turn: Turn) -> None:
        task = asyncio.create_task(self._write(response_id, turn), name="stored-response-write")
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, response_id: str, turn: Turn, *, refresh: bool = False) -> None:
        """The record to the feed; `refresh`: its chain's expiry renewed too (a new turn's)."""
        if self.board is None:
            return
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                await self.board.put(response_id, turn.previous, _encode(turn), refresh=refresh)
        except Exception as exc:  # noqa: BLE001 - unreachable, or refused (a full Redis): never the answer's failure
            self.count("write_failed")
            log.warning("a stored response's record was not shared (feed unreachable: %s); a follow-up to it "
                        "through another gateway will be answered 404", type(exc).__name__)

    async def holder(self, response_id: str, owner: str, *, param: str) -> Turn:
        """The record of `response_id`, if `owner`'s; else 404 (module rules)."""
        turn = self._turns.get(response_id)
        if turn is None:
            chain = await self._read_chain(response_id, 1)
            turn = chain[0][1] if chain else None
        if turn is None or turn.owner != owner:
            self.count("not_found")
            raise not_found(response_id, param)
        if response_id in self._turns:
            self._turns.move_to_end(response_id)
        return turn

    async def history(self, response_id: str, owner: str) -> tuple[str, list[dict]]:
        """The replica holding `response_id` and the history a follow-up to it renders (module rules)."""
        turns = await self._chain(response_id)
        if not turns or turns[0][1].owner != owner:
            self.count("not_found")
            raise not_found(response_id, "previous_response_id")
        if turns[-1][1].previous is not None:
            self.count("history_lost")
            raise not_found(response_id, "previous_response_id", why="its earlier turns are no longer recorded")
        history: list[dict] = []
        for rid, turn in reversed(turns):
            history += turn.said
            history += turn.answer if turn.answer is not None else await self._fetched_answer(rid, turn)
        if response_id in self._turns:
            self._turns.move_to_end(response_id)
        self.count("followed")
        return turns[0][1].replica_id, history

    async def _chain(self, response_id: str) -> list[tuple[str, Turn]]:
        """The records from `response_id` back through the previous ones, newest first, as far as
        they are known here or in the feed (at most MAX_DEPTH)."""
        turns: list[tuple[str, Turn]] = []
        rid: str | None = response_id
        while rid is not None and len(turns) < MAX_DEPTH:
            turn = self._turns.get(rid)
            if turn is not None:
                turns.append((rid, turn))
                rid = turn.previous
                continue
            chain = await self._read_chain(rid, MAX_DEPTH - len(turns))
            if not chain:
                break
            turns += chain
            rid = chain[-1][1].previous
        return turns

    async def _read_chain(self, response_id: str, depth: int) -> list[tuple[str, Turn]]:
        if self.board is None:
            return []
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                raw = await self.board.chain(response_id, depth)
        except Exception as exc:  # noqa: BLE001 - unreachable (FeedUnavailable, a timeout), or a refusal
            self.count("feed_unreachable")
            raise ApiError(503, f"the stored responses' records are unreachable (the feed: {type(exc).__name__})",
                           code="feed_unavailable", headers={"Retry-After": "1"}) from None
        out = []
        for rid, prev_id, blob in raw:
            turn = _decode(prev_id, blob)
            if turn is None:  # not a record this gateway wrote: as if not found
                break
            out.append((rid, turn))
        for rid, turn in reversed(out):  # the newest kept last, so evicted last
            self._keep(rid, turn)
        return out

    async def _fetched_answer(self, response_id: str, turn: Turn) -> list[dict]:
        """A recorded response's answer from its replica (module rules); kept once final."""
        response = await self.fetch(turn.replica_id, response_id)
        if response is None:
            self.count("history_lost")
            raise not_found(response_id, "previous_response_id", why="its replica no longer holds it")
        self.count("answer_fetched")
        answer = final_output(response)
        if answer is not None:
            turn.answer = answer
            self._write_later(response_id, turn)  # the other gateways need not ask again
            return answer
        return output_messages(response.get("output"))  # still running: vLLM renders what it has so far

    async def close(self) -> None:
        for t in list(self._writes):
            t.cancel()
        await asyncio.gather(*self._writes, return_exceptions=True)


def fetcher(session: aiohttp.ClientSession, membership, timeout_s: float) -> Fetch:
    """`Fetch` over HTTP: the replica's `GET /v1/responses/{id}` (None: not there, or the replica
    left the pool; a failure to answer is 502)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def fetch(replica_id: str, response_id: str) -> dict | None:
        st = membership.get(replica_id)
        if st is None:
            return None
        try:
            async with session.get(f"{st.url}/v1/responses/{quote(response_id, safe='')}", timeout=timeout) as r:
                if r.status == 404:
                    return None
                if r.status != 200:
                    raise ApiError(502, f"the replica holding the previous response answered {r.status} when asked "
                                        "for it", code="upstream_unavailable", headers={"Retry-After": "1"})
                body = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise ApiError(502, f"the replica holding the previous response could not be asked for it "
                                f"({type(exc).__name__})", code="upstream_unavailable",
                           headers={"Retry-After": "1"}) from None
        return body if isinstance(body, dict) else None

    return fetch


def lost_response(body: bytes) -> bool:
    """An engine's 404 body says it does not hold the response (vLLM: "Response with id '...' not found.")."""
    return b"Response with id" in body


def not_found(response_id: str, param: str, *, why: str = "") -> ApiError:
    shown = response_id if len(response_id) <= 64 and response_id.isprintable() else "(malformed)"
    return ApiError(404, f"Response with id '{shown}' not found{f' ({why})' if why else ''}.", param=param,
                    code="response_not_found")
