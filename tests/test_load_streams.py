"""1,000 concurrent streams through one gateway process: zero errors, and bounded memory.

Two simulated replica processes (`--max-num-seqs 1024`, so every stream runs at once), one gateway
process (load only: this is about the proxy path), and 1,000 streamed chats opened together from
this process, twice. What must hold: every stream is whole (no error, no missing [DONE]); the
gateway's resident memory at the peak of a round stays within `PEAK_GROWTH_BYTES` of its size after
warm-up, and the second round does not grow it further (within `ROUND_GROWTH_BYTES`); its open
file descriptors after each round come back to the warm pool's count."""
from __future__ import annotations

import asyncio
import resource
import threading
import time

import aiohttp
import pytest

from tests.fault_harness import Procs, fd_count, rss_bytes, stream_chat

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

STREAMS = 1000
PEAK_GROWTH_BYTES = 150 << 20
ROUND_GROWTH_BYTES = 16 << 20


class Sampler:
    """Peak RSS of a process, sampled every 50 ms in a thread (off the client's event loop)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            time.sleep(0.05)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


async def _round(url: str, n: int, tag: str) -> list:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        return await asyncio.gather(*(stream_chat(s, url, f"{tag} stream {i}: hello", max_tokens=16, timeout_s=120)
                                      for i in range(n)))


async def test_thousand_concurrent_streams(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft >= 4 * STREAMS, f"ulimit -n is {soft}: the test needs about {4 * STREAMS} descriptors"
    with Procs(tmp_path) as procs:
        sims = [procs.sim(f"s{i}", "--max-num-seqs", "1024", "--max-num-batched-tokens", "65536") for i in range(2)]
        for s in sims:
            procs.wait(s)
        g = procs.gateway("gw", {"membership": {"replicas": [f"s{i}={s.url}" for i, s in enumerate(sims)]},
                                 "auth": {"enabled": False}, "feed": {"load_only": True},
                                 "model": {"name": "warmroute-sim", "max_model_len": 8192},
                                 "policy": {"name": "least_loaded"}, "telemetry": {"log_level": "WARNING"}})
        procs.wait(g, "/readyz", base=g.admin_url)
        warm = await _round(g.url, 200, "warm-up")
        assert all(x.whole for x in warm)
        time.sleep(1.0)
        rss0, fds0 = rss_bytes(g.pid), fd_count(g.pid)
        results, peaks, after = [], [], []
        for r in range(2):
            t0 = time.monotonic()
            with Sampler(g.pid) as smp:
                seen = await _round(g.url, STREAMS, f"round {r}")
            results.append((seen, time.monotonic() - t0))
            peaks.append(smp.peak)
            time.sleep(1.0)
            after.append((rss_bytes(g.pid), fd_count(g.pid)))
        g_alive = g.alive()
    assert g_alive
    for seen, _ in results:
        bad = [(x.status, x.exc, x.error_event) for x in seen if not x.whole]
        assert not bad, bad[:5]
    print(f"\n{STREAMS} concurrent streams x2: 0 errors; rounds {results[0][1]:.1f}s / {results[1][1]:.1f}s; gateway RSS "
          f"after warm-up {rss0 / 2**20:.0f} MiB, peaks {peaks[0] / 2**20:.0f} / {peaks[1] / 2**20:.0f} MiB, after "
          f"{after[0][0] / 2**20:.0f} / {after[1][0] / 2**20:.0f} MiB; fds {fds0} -> {after[0][1]} / {after[1][1]}")
    assert max(peaks) - rss0 < PEAK_GROWTH_BYTES, (rss0, peaks)
    assert peaks[1] - peaks[0] < ROUND_GROWTH_BYTES, peaks
    # Descriptors: client sockets closed; what stays is the upstream keep-alive pool (at most one per stream).
    assert after[1][1] <= after[0][1] + 8, (fds0, after)
    assert after[0][1] <= fds0 + 2 * STREAMS, (fds0, after)
