"""The processes of a comparison run and the simulated replicas' side of it: `Procs` (each child
the leader of its own process group, stopped by that id, its CPU counted over the group),
readiness waits that report a dead process's log, and the sims' counters (/metrics, /sim/stats),
drain and prefix-cache reset between routers. Used by compare_peers and profile_gateway.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from loadtests.processes import stop_processes

__all__ = ["Procs", "Unavailable", "SIM_COUNTERS", "drain_and_reset", "drain_sims", "sim_counters", "wait_ready"]

_CLK = os.sysconf("SC_CLK_TCK")
SIM_COUNTERS = {
    "vllm:time_to_first_token_seconds_count": "requests",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:prefix_cache_queries_total": "cache_queries_tokens",
    "vllm:prefix_cache_hits_total": "cache_hits_tokens",
    "vllm:num_preemptions_total": "preemptions",
    "warmroute_sim_steps_total": "steps",
    "warmroute_sim_step_modelled_seconds_total": "modelled_s",
    "warmroute_sim_step_actual_seconds_total": "actual_s",
    "warmroute_sim_step_lateness_max_seconds": "lateness_max_s",
}


class Unavailable(RuntimeError):
    """A router that could not be installed, started or reached."""


# ------------------------------------------------------------------------------ processes


class Procs:
    """Child processes, each the leader of its own process group; stopped by that id."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "wb")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env={**os.environ, **(env or {})}, start_new_session=True)
        log.close()
        self.procs[name] = p
        return p

    def log_tail(self, name: str, n: int = 12) -> str:
        try:
            lines = (self.logdir / f"{name}.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-n:])[-1500:]

    def alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def cpu_s(self, name: str) -> float:
        """utime+stime of every live process in `name`'s process group."""
        p = self.procs.get(name)
        if p is None:
            return 0.0
        total = 0
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    st = f.read()
            except OSError:
                continue
            fields = st[st.rfind(")") + 2:].split()
            if int(fields[2]) == p.pid:  # pgrp
                total += int(fields[11]) + int(fields[12])
        return total / _CLK

    def stop(self, name: str, timeout_s: float = 10.0) -> None:
        p = self.procs.pop(name, None)
        if p is None:
            return
        stop_processes([p], timeout_s, group=True)  # the group may outlive its leader: swept too

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            self.stop(name)


async def wait_ready(session: aiohttp.ClientSession, url: str, procs: Procs, name: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if not procs.alive(name):
            raise Unavailable(f"{name} exited (rc={procs.procs[name].returncode}): {procs.log_tail(name)}")
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
                last = f"HTTP {r.status}: {(await r.text())[:200]}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(0.2)
    raise Unavailable(f"{name} not ready at {url} after {timeout_s:.0f}s ({last}); log: {procs.log_tail(name)}")


# ------------------------------------------------------------------------------ sims


def parse_sim_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = SIM_COUNTERS.get(name)
        if key is not None:
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def sim_counters(session: aiohttp.ClientSession, sims: dict[str, str]) -> dict[str, dict]:
    async def one(url: str) -> dict:
        async with session.get(url + "/metrics") as r:
            m = parse_sim_metrics(await r.text())
        async with session.get(url + "/sim/stats") as r:
            m["stats"] = await r.json()
        return m

    vals = await asyncio.gather(*(one(u) for u in sims.values()))
    return dict(zip(sims, vals))


async def drain_and_reset(session: aiohttp.ClientSession, sims: dict[str, str], timeout_s: float) -> float:
    """Wait until no sim has work, then reset every prefix cache; return seconds waited."""
    t0 = time.monotonic()
    await drain_sims(session, sims, timeout_s)
    for url in sims.values():
        async with session.post(url + "/reset_prefix_cache") as r:
            if r.status != 200:
                raise RuntimeError(f"reset_prefix_cache on {url}: HTTP {r.status}")
    await asyncio.sleep(1.0)  # AllBlocksCleared -> agents -> feed
    return time.monotonic() - t0


async def drain_sims(session: aiohttp.ClientSession, sims: dict[str, str], timeout_s: float) -> None:
    """Wait until no sim has work (restarting them after `timeout_s`)."""
    t0 = time.monotonic()
    while True:
        stats = await sim_counters(session, sims)
        busy = {rid: (s["stats"]["num_running"], s["stats"]["num_waiting"]) for rid, s in stats.items()
                if s["stats"]["num_running"] or s["stats"]["num_waiting"]}
        if not busy:
            break
        if time.monotonic() - t0 > timeout_s:
            # last resort: drop everything, like a new engine process (the agents resync)
            print(f"  sims still busy after {timeout_s:.0f}s {busy}: restarting them (fault restart)", file=sys.stderr)
            for url in sims.values():
                async with session.post(url + "/sim/fault", json={"kind": "restart"}) as r:
                    await r.read()
            await asyncio.sleep(2.0)
            return
        await asyncio.sleep(0.5)
