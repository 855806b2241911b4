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
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from loadtests.vtime_replica import SimReq

__all__ = ["Pacing", "PaceChains"]

_CHUNK_ID_BASE = 1 << 40  # chunk requests' indices, above any workload's (their output keys stay private)


@dataclass(frozen=True, slots=True)
class Pacing:
    min_uncached: int = 1024  # predicted uncached tokens from which a request is paced
    chunk: int = 512  # tokens each chunk adds (rounded down to whole blocks)
    follow: bool = True  # requests needing a prefix a chain is warming wait for it

    def __post_init__(self) -> None:
        if self.min_uncached < 1 or self.chunk < 1:
            raise ValueError("pacing needs min_uncached >= 1 and chunk >= 1")


@dataclass(slots=True)
class _Chain:
    parent: SimReq  # the paced request
    cuts: list  # prefix lengths (tokens) still to send, in order
    keys: set  # the parent's block keys (what a follower may need)
    replica: int
    followers: list = field(default_factory=list)  # requests waiting for the chain to end


class PaceChains:
    """The chains in progress: which chunk comes next, and who waits for each chain."""

    def __init__(self, pacing: Pacing, block_size: int) -> None:
        self.pacing = pacing
        self.bs = block_size
        self.chains: dict = {}  # id(parent) -> _Chain
        self.n = 0  # chunks sent
        self.paced: list = []  # every request a chain was started for

    def cuts(self, r: SimReq) -> list[int]:
        """Prefix lengths (tokens) to warm before `r`, from what its replica is predicted to hold."""
        pc = self.pacing
        if r.pred_uncached < pc.min_uncached:
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
            chain = self.chains[id(r)] = _Chain(r, cuts, set(r.keys), ri)
            self.paced.append(r)
            return [self._next(chain)]
        if self.pacing.follow and r.keys:
            need = r.keys[min(len(r.keys) - 1, self.pacing.min_uncached // self.bs)]
            for chain in self.chains.values():
                if chain.replica == ri and need in chain.keys:
                    chain.followers.append(r)
                    return []
        return [r]

    def chunk_done(self, c: SimReq) -> list[SimReq]:
        """Chunk `c` finished: the chain's next chunk, or its request and followers still waiting."""
        chain = self.chains[c.pace]
        if chain.cuts:
            return [self._next(chain)]
        del self.chains[c.pace]
        return [r for r in [chain.parent, *chain.followers] if not r.aborted]

    def _next(self, chain: _Chain) -> SimReq:
        parent = chain.parent
        n_tok = chain.cuts.pop(0)
        self.n += 1
        wr = SimpleNamespace(prompt_tokens=n_tok, max_output_tokens=1, request_id=f"pace-{self.n}")
        rk = SimpleNamespace(prompt=list(parent.keys[: n_tok // self.bs]), output=None)
        c = SimReq(_CHUNK_ID_BASE + self.n, wr, rk, parent.arrival)
        c.pace = id(parent)
        c.rep = parent.rep
        return c
