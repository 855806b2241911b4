"""A design probe in virtual time: paced prefill of long misses (the gateway does not pace).

What it models (`simulate(..., pacing=Pacing(...))`, `vtime_report --pace-min N`): a request the
router predicts to find at least `min_uncached` tokens uncached on its replica is not sent whole.
Its replica first gets the prompt's prefixes as separate one-token requests, each `chunk` tokens
(block-aligned) longer than the last, one at a time, then the request itself, whose own remainder
is then under ~1.5 chunks. With `follow`, a request routed to a replica while a chain there is
warming the prefix it needs joins the queue only when the chain's request does.

Why it might help: the engine serves a running request's prefill chunks before it admits waiting
requests, so one 3,000-token miss in 512-token steps holds every request queued behind it on that
replica for ~3 s (the busy regime's Zipf tail). Cut into separate requests, each chunk joins the
FCFS waiting queue, so requests that arrived meanwhile are admitted first; the miss itself waits
longer. Without `follow`, the engine admits same-prefix requests between chunks and they prefill
the rest unpaced.

What a gateway would need to do the same (not built): send the chunks itself as completions of
token ids with the request's cache salt and max_tokens 1, hold the request and its followers until
they finish, and count their prefill in the replica's in-flight load.

Copies in the background (`cache_plan(copy_in_background=True)`, `vtime_report
--copy-in-background`): when the plan gives a prefix a new holder, the request that triggered it
goes to an existing holder, and the new holder gets the prefix as a warm chain (`warm()`): the
same one-token requests, `chunk` tokens each with pacing and the whole prefix in one without,
which no client waits for (a chunk as long as the prefix: one warm request). The new holder joins
the holders once the index shows the prefix there (the warm inserts no speculative entries), so no
request waits for a copy's prefill.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from loadtests.vtime_replica import SimReq

__all__ = ["Pacing", "PaceChains"]

_CHUNK_ID_BASE = 1 << 40  # chunk requests' indices, above any workload's (their output keys stay private)


@dataclass(frozen=True, slots=True)
class Pacing:
    min_uncached: int | None = 1024  # predicted uncached tokens from which a request is paced; None: none is (warms only)
    chunk: int = 512  # tokens each chunk adds (rounded down to whole blocks)
    follow: bool = True  # requests needing a prefix a chain is warming wait for it

    def __post_init__(self) -> None:
        if (self.min_uncached is not None and self.min_uncached < 1) or self.chunk < 1:
            raise ValueError("pacing needs min_uncached >= 1 (or None) and chunk >= 1")


@dataclass(slots=True)
class _Chain:
    parent: SimReq | None  # the paced request; None for a background warm
    cuts: list  # prefix lengths (tokens) still to send, in order
    prefix: tuple  # the block keys being warmed, in order
    replica: int
    arrival: float
    followers: list = field(default_factory=list)  # requests waiting for the chain to end
    flight: object = None  # a warm's in-flight count at the router (gateway.load.Flight), ended with the chain


class PaceChains:
    """The chains in progress: which chunk comes next, and who waits for each chain. `pacing`
    None: no request is paced (background warms only)."""

    def __init__(self, pacing: Pacing | None, block_size: int) -> None:
        self.pacing = pacing
        self.bs = block_size
        self.chains: dict = {}  # chain id (id(parent), or a warm's own) -> _Chain
        self.n = 0  # chunks sent
        self.paced: list = []  # every request a chain was started for
        self.warms = 0  # background warms started
        self.paces_requests = pacing is not None and pacing.min_uncached is not None

    def cuts(self, r: SimReq) -> list[int]:
        """Prefix lengths (tokens) to warm before `r`, from what its replica is predicted to hold."""
        pc = self.pacing
        if not self.paces_requests or r.pred_uncached < pc.min_uncached:
            return []
        step = max(self.bs, pc.chunk // self.bs * self.bs)
        start = (r.prompt - r.pred_uncached) // self.bs * self.bs
        out, c = [], start + step
        while c <= r.prompt - step // 2:
            out.append(c)
            c += step
        return out

    def admit(self, r: SimReq, ri: int) -> list[SimReq]:
        """What replica `ri`'s queue gets now for the routed request `r` (maybe nothing yet)."""
        cuts = self.cuts(r)
        if cuts:
            chain = self.chains[id(r)] = _Chain(r, cuts, tuple(r.keys), ri, r.arrival)
            self.paced.append(r)
            return [self._next(id(r), chain)]
        if self.paces_requests and self.pacing.follow and r.keys:
            need = r.keys[min(len(r.keys) - 1, self.pacing.min_uncached // self.bs)]
            for chain in self.chains.values():
                if chain.parent is not None and chain.replica == ri and need in chain.prefix:
                    chain.followers.append(r)
                    return []
        return [r]

    def warm(self, prefix: tuple, ri: int, t: float, flight=None) -> SimReq:
        """Start warming `prefix` (block keys) on replica `ri` at time `t`, no client waiting: its
        first chunk (the queue's), the rest as each finishes; `flight` ends with the chain."""
        n_tok = len(prefix) * self.bs
        step = max(self.bs, self.pacing.chunk // self.bs * self.bs) if self.pacing is not None else n_tok
        cuts = list(range(step, n_tok, step)) + [n_tok]
        self.warms += 1
        cid = -self.warms  # a warm's chain id: negative, never an id(request)
        chain = self.chains[cid] = _Chain(None, cuts, tuple(prefix), ri, t, flight=flight)
        return self._next(cid, chain)

    def chunk_done(self, c: SimReq) -> list[SimReq]:
        """Chunk `c` finished: the chain's next chunk, or its request and followers still waiting."""
        chain = self.chains[c.pace]
        if chain.cuts:
            return [self._next(c.pace, chain)]
        del self.chains[c.pace]
        if chain.flight is not None:
            chain.flight.finish()
        waiting = [chain.parent] if chain.parent is not None else []
        return [r for r in waiting + chain.followers if not r.aborted]

    def _next(self, cid: int, chain: _Chain) -> SimReq:
        n_tok = chain.cuts.pop(0)
        self.n += 1
        wr = SimpleNamespace(prompt_tokens=n_tok, max_output_tokens=1, request_id=f"pace-{self.n}",
                             lora=None)  # the pacing probe runs base-model workloads
        rk = SimpleNamespace(prompt=list(chain.prefix[: n_tok // self.bs]), output=None)
        c = SimReq(_CHUNK_ID_BASE + self.n, wr, rk, chain.arrival)
        c.pace = cid
        c.rep = chain.replica
        return c
