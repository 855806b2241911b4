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

`add_keep_alive_args` / `keep_alive_from_args`: the `--keep-alive*` flags of the virtual-time tools
(vtime_report, vtime_trace), one definition for both.
"""
from __future__ import annotations

import argparse
from types import SimpleNamespace

from gateway.keepalive import KeepAlive, Refresh, Retainer
from loadtests.vtime_replica import SimReq

__all__ = ["KeepAlive", "Retainer", "KEEPALIVE", "queue_refresh", "refresh_request", "add_keep_alive_args",
           "keep_alive_from_args"]

KEEPALIVE = "keepalive"  # SimReq.pace of a refresh (no chain, no client)
_REFRESH_ID_BASE = 1 << 41  # refresh requests' indices, above any workload's and the pace chunks'


def refresh_request(rf: Refresh, n: int, block_size: int, t: float) -> SimReq:
    """Refresh `rf` (replica index, keys) as the `n`-th modelled refresh request, sent at `t`."""
    wr = SimpleNamespace(prompt_tokens=len(rf.keys) * block_size + 1, max_output_tokens=1, request_id=f"keepalive-{n}",
                         refresh=rf, lora=rf.payload)  # the payload: the root's LoRA adapter (loadtests/vtime.py)
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


def add_keep_alive_args(ap: argparse.ArgumentParser) -> None:
    """The `--keep-alive*` flags (`keep_alive_from_args` reads them)."""
    ap.add_argument("--keep-alive", type=float, default=0.0, metavar="IDLE_S",
                    help="keep-alive (the gateway's keep_alive rules, loadtests/vtime_keepalive.py): a long prefix not "
                         "used on its replica for IDLE_S seconds is refreshed there (default 0: off)")
    ap.add_argument("--keep-alive-kv-frac", type=float, default=KeepAlive().kv_frac, metavar="F",
                    help="with --keep-alive: a replica's kept prefixes stay under this share of its KV (default %(default)s)")
    ap.add_argument("--keep-alive-in-flight", type=int, default=KeepAlive().max_in_flight, metavar="N",
                    help="with --keep-alive: refreshes out at once per replica (default: the gateway's "
                         "keep_alive.max_in_flight default, %(default)s)")
    ap.add_argument("--keep-alive-max-waiting", type=int, default=KeepAlive().max_waiting, metavar="N",
                    help="with --keep-alive: no refresh to a replica whose last load report has more requests waiting "
                         "(default: the gateway's keep_alive.max_waiting default, %(default)s)")
    ap.add_argument("--keep-alive-priority", action="store_true",
                    help="with --keep-alive: refreshes wait ahead of every request (the gateway's keep_alive.engine_priority "
                         "on engines run with vLLM's --scheduling-policy priority); default: at the back of the queue")


def keep_alive_from_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> KeepAlive | None:
    """The rules `add_keep_alive_args`' flags give (None: off); a bad value is the parser's error."""
    if args.keep_alive_priority and not args.keep_alive:
        ap.error("--keep-alive-priority goes with --keep-alive")
    if (args.keep_alive < 0 or not 0 < args.keep_alive_kv_frac <= 1 or args.keep_alive_in_flight < 1
            or args.keep_alive_max_waiting < 0):
        ap.error("--keep-alive takes seconds >= 0 (0: off), --keep-alive-kv-frac a share in (0, 1], "
                 "--keep-alive-in-flight a count >= 1 and --keep-alive-max-waiting a count >= 0")
    if not args.keep_alive:
        return None
    return KeepAlive(idle_s=args.keep_alive, kv_frac=args.keep_alive_kv_frac, max_in_flight=args.keep_alive_in_flight,
                     max_waiting=args.keep_alive_max_waiting)
