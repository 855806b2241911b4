"""Replica membership and health.

Pure part (`Membership`): the set of replicas (id -> URL), each with an active-probe verdict and
a passive-ejection state. A replica is *available* when its last probe did not fail and it is
not ejected (a slow probe counts only after `probe_timeouts_to_down` consecutive timeouts: a busy
engine answers /health late, and ejecting it for that would move its warm prefixes; a refused
connection or a non-200 answer counts at once). Passive ejection: a failure before the first byte (connect refused, 5xx, timeout)
ejects it for `eject_base_s x 2^(consecutive failures - 1)`, capped at `eject_max_s`; a success
resets the count. A successful probe does not end an ejection early (the backoff is the point);
a failed probe marks the replica down until a probe succeeds. A newly added replica starts
available (optimistic: the first probe follows within one interval, and failures eject it).
A replica that answered a request within the last probe interval (`report_success`) is not
probed: the answer is the evidence a probe would fetch (`ReplicaState.needs_probe`), and each
probe is a request through the client of the gateway's one event loop.
`set_members` returns what joined and what left; the owner purges leavers from the KV index.

I/O part (`MembershipRunner`): resolves a Kubernetes headless Service by DNS (A records; replica
id = "IP:port") every `dns_refresh_s`, and probes every replica's health path every
`health_interval_s`. Started and cancelled by the server, never by a constructor.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass
from typing import Callable, Mapping

__all__ = ["ReplicaState", "Membership", "MembershipRunner"]

log = logging.getLogger("warmroute.gateway.membership")


@dataclass(slots=True)
class ReplicaState:
    replica_id: str  # id as the agent reports it
    url: str  # base URL without trailing slash
    probe_ok: bool | None = None  # last active probe (None: not probed yet)
    failures: int = 0  # consecutive passive failures
    ejected_until: float = 0.0  # monotonic time the ejection ends
    ejections: int = 0  # ejections ever
    last_error: str = ""  # short reason of the last failure
    probe_timeouts: int = 0  # consecutive active probes that timed out
    served_at: float = float("-inf")  # clock() when it last answered a request (report_success)

    def available(self, now: float) -> bool:
        return self.probe_ok is not False and now >= self.ejected_until

    def needs_probe(self, interval_s: float, now: float) -> bool:
        """False while its last probe passed and it answered a request within `interval_s`."""
        return self.probe_ok is not True or now - self.served_at >= interval_s


class Membership:
    def __init__(self, *, eject_base_s: float = 1.0, eject_max_s: float = 30.0, probe_timeouts_to_down: int = 3,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if probe_timeouts_to_down < 1:
            raise ValueError("probe_timeouts_to_down must be >= 1")
        self.probe_timeouts_to_down = probe_timeouts_to_down
        self.eject_base_s = eject_base_s
        self.eject_max_s = eject_max_s
        self.clock = clock
        self._replicas: dict[str, ReplicaState] = {}

    def set_members(self, members: Mapping[str, str]) -> tuple[list[str], list[str]]:
        """Replace the member set (id -> URL). Returns (added ids, removed ids)."""
        added, removed = [], []
        for rid in list(self._replicas):
            if rid not in members:
                del self._replicas[rid]
                removed.append(rid)
        for rid, url in members.items():
            url = url.rstrip("/")
            st = self._replicas.get(rid)
            if st is None:
                self._replicas[rid] = ReplicaState(rid, url)
                added.append(rid)
            elif st.url != url:
                self._replicas[rid] = ReplicaState(rid, url)
        return added, removed

    def get(self, rid: str) -> ReplicaState | None:
        return self._replicas.get(rid)

    def all(self) -> list[ReplicaState]:
        return list(self._replicas.values())

    def ids(self) -> list[str]:
        return list(self._replicas)

    def available(self, rid: str, now: float | None = None) -> bool:
        st = self._replicas.get(rid)
        return st is not None and st.available(self.clock() if now is None else now)

    def any_available(self) -> bool:
        now = self.clock()
        return any(st.available(now) for st in self._replicas.values())

    def report_failure(self, rid: str, reason: str) -> float:
        """A failure before the first byte: eject with exponential backoff. Returns the seconds."""
        st = self._replicas.get(rid)
        if st is None:
            return 0.0
        st.failures += 1
        backoff = min(self.eject_max_s, self.eject_base_s * (2 ** min(st.failures - 1, 30)))
        st.ejected_until = self.clock() + backoff
        st.ejections += 1
        st.last_error = reason[:200]
        return backoff

    def report_success(self, rid: str) -> None:
        st = self._replicas.get(rid)
        if st is not None:
            st.served_at = self.clock()
            st.failures = 0
            st.probe_timeouts = 0  # it answered: slow probes before the answer were a busy engine's

    def probe_result(self, rid: str, ok: bool, reason: str = "", timed_out: bool = False) -> None:
        st = self._replicas.get(rid)
        if st is None:
            return
        if ok:
            st.probe_ok, st.probe_timeouts = True, 0
            return
        st.last_error = reason[:200] or "health probe failed"
        if timed_out:
            st.probe_timeouts += 1
            if st.probe_timeouts < self.probe_timeouts_to_down:
                return  # slow, not (yet) down
        st.probe_ok = False


class MembershipRunner:
    """Background DNS refresh and health probes (thin I/O around `Membership`)."""

    def __init__(self, membership: Membership, session, *, health_path: str, health_interval_s: float,
                 health_timeout_s: float, dns_service: str | None = None, dns_port: int = 8000,
                 dns_refresh_s: float = 10.0, on_change: Callable[[list[str], list[str]], None] | None = None) -> None:
        self.m = membership
        self.session = session  # aiohttp.ClientSession shared with the proxy
        self.health_path = health_path
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.dns_service = dns_service
        self.dns_port = dns_port
        self.dns_refresh_s = dns_refresh_s
        self.on_change = on_change
        self.dns_ok: bool | None = None  # last resolution succeeded

    async def resolve_once(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(self.dns_service, self.dns_port, family=socket.AF_INET, type=socket.SOCK_STREAM)
        except OSError as exc:
            # keep the last known members: a DNS hiccup must not empty the pool
            self.dns_ok = False
            log.warning("dns resolution of %s failed: %s", self.dns_service, exc)
            return
        ips = sorted({info[4][0] for info in infos})
        members = {f"{ip}:{self.dns_port}": f"http://{ip}:{self.dns_port}" for ip in ips}
        self.dns_ok = True
        added, removed = self.m.set_members(members)
        if (added or removed) and self.on_change is not None:
            self.on_change(added, removed)

    async def dns_loop(self) -> None:
        while True:
            await self.resolve_once()
            await asyncio.sleep(self.dns_refresh_s)

    async def probe_one(self, st: ReplicaState) -> None:
        import aiohttp

        try:
            async with self.session.get(st.url + self.health_path,
                                        timeout=aiohttp.ClientTimeout(total=self.health_timeout_s)) as resp:
                await resp.read()
                ok = resp.status == 200
                self.m.probe_result(st.replica_id, ok, f"health probe status {resp.status}")
        except asyncio.TimeoutError:
            self.m.probe_result(st.replica_id, False, "health probe timed out", timed_out=True)
        except (aiohttp.ClientError, OSError) as exc:
            self.m.probe_result(st.replica_id, False, f"health probe: {type(exc).__name__}")

    async def probe_all(self) -> None:
        now = self.m.clock()
        states = [st for st in self.m.all() if st.needs_probe(self.health_interval_s, now)]
        if states:
            await asyncio.gather(*(self.probe_one(st) for st in states))

    async def probe_loop(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.health_interval_s)
