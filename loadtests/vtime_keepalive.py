"""The keep-alive of long prefixes (gateway/keepalive.py) in virtual time: its refreshes as
modelled requests.

`simulate(..., keep_alive=KeepAlive(...))`, `vtime_report --keep-alive IDLE_S`: every load report
the gateway's `Retainer` says which kept prefixes are due (the plan's roots; module rules there),
with the replica's KV as its budget, and each refresh joins its replica's queue as a request of
the prefix's blocks plus one token, max_tokens 1: it takes a sequence slot and one prefill token
like any request, and carries no client, no timeout and no in-flight count in the router's load
(the gateway does not count its refreshes there either); when it finishes the retainer is told
(`Retainer.done`; the refresh is `wr.refresh`), as the gateway does when its answer comes. It
waits at the back of the queue (FCFS engines), or with `refresh_first` (`--keep-alive-priority`:
the gateway's keep_alive.engine_priority on engines run with vLLM's priority policy, which orders
its waiting queue by (priority, arrival)) behind the refreshes already waiting and ahead of every
request.
"""
from __future__ import annotations

from types import SimpleNamespace

from gateway.keepalive import KeepAlive, Refresh, Retainer
from loadtests.vtime_replica import SimReq

__all__ = ["KeepAlive", "Retainer", "KEEPALIVE", "queue_refresh", "refresh_request"]

KEEPALIVE = "keepalive"  # SimReq.pace of a refresh (no chain, no client)
_REFRESH_ID_BASE = 1 << 41  # refresh requests' indices, above any workload's and the pace chunks'


def refresh_request(rf: Refresh, n: int, block_size: int, t: float) -> SimReq:
    """Refresh `rf` (replica index, keys) as the `n`-th modelled refresh request, sent at `t`."""
    wr = SimpleNamespace(prompt_tokens=len(rf.keys) * block_size + 1, max_output_tokens=1, request_id=f"keepalive-{n}",
                         refresh=rf)
    r = SimReq(_REFRESH_ID_BASE + n, wr, SimpleNamespace(prompt=list(rf.keys), output=None), t)
    r.pace = KEEPALIVE
    r.rep = rf.replica
    return r


def queue_refresh(waiting, r: SimReq, *, first: bool) -> None:
    """Put refresh `r` in a replica's waiting queue (module header)."""
    if not first:
        waiting.append(r)
        return
    i = 0
    while i < len(waiting) and waiting[i].pace is KEEPALIVE:
        i += 1
    waiting.insert(i, r)
