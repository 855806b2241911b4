"""The engine's load, from its Prometheus `/metrics` (vLLM's metric names).

Rule: `parse_load(text, ts)` is pure: it reads vllm:num_requests_running / _waiting (summed over
engines), vllm:kv_cache_usage_perc (mean over engines, a fraction), the prefix-cache counters
vllm:prefix_cache_queries_total / _hits_total (summed, tokens), and the labels `block_size` and
`num_gpu_blocks` of vllm:cache_config_info (summed blocks; block size of the first), and the LoRA
slots from vllm:lora_requests_info. A metric that is absent reads as 0. Text that is not the
Prometheus exposition format raises ValueError.

vllm:lora_requests_info (engines with --enable-lora) is a gauge whose labels carry the state:
`max_lora`, and the comma-joined names of the adapters with running and with waiting requests;
each step sets the series of its label set to the current time, and the series of earlier label
sets stay in the exposition, so the state is the series with the largest value.
`Scraper.scrape()` is the I/O edge: one GET with a timeout.
"""
from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from .feed.records import LoadReport

__all__ = ["Scraper", "parse_load"]


def parse_load(text: str, ts: float | None = None) -> LoadReport:
    sums: dict[str, float] = {}
    usage: list[float] = []
    block_size = 0
    num_gpu_blocks = 0
    lora: tuple[float, dict] | None = None  # (the newest series' time, its labels)
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError/IndexError/... on garbage
        raise ValueError(f"engine /metrics is not Prometheus text: {exc}") from exc
    for fam in families:
        for s in fam.samples:
            name = s.name
            if name == "vllm:kv_cache_usage_perc":
                usage.append(float(s.value))
            elif name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                          "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
                sums[name] = sums.get(name, 0.0) + float(s.value)
            elif name == "vllm:cache_config_info":
                try:
                    if not block_size:
                        block_size = int(s.labels.get("block_size", 0) or 0)
                    num_gpu_blocks += int(s.labels.get("num_gpu_blocks", 0) or 0)
                except ValueError:
                    pass
            elif name == "vllm:lora_requests_info":
                if lora is None or float(s.value) > lora[0]:
                    lora = (float(s.value), s.labels)
    max_lora, running, waiting = _lora_slots(lora[1]) if lora is not None else (0, (), ())
    return LoadReport(
        running_reqs=int(sums.get("vllm:num_requests_running", 0)),
        waiting_reqs=int(sums.get("vllm:num_requests_waiting", 0)),
        kv_usage=sum(usage) / len(usage) if usage else 0.0,
        prefix_cache_queries_total=sums.get("vllm:prefix_cache_queries_total", 0.0),
        prefix_cache_hits_total=sums.get("vllm:prefix_cache_hits_total", 0.0),
        num_gpu_blocks=num_gpu_blocks,
        block_size=block_size,
        ts=time.time() if ts is None else ts,
        max_lora=max_lora,
        lora_running=running,
        lora_waiting=waiting,
    )


def _names(label: str | None) -> tuple[str, ...]:
    return tuple(n for n in (label or "").split(",") if n)


def _lora_slots(labels: dict) -> tuple[int, tuple[str, ...], tuple[str, ...]]:
    """(max_lora, running adapters, waiting adapters) from a vllm:lora_requests_info series."""
    try:
        max_lora = max(0, int(float(labels.get("max_lora", 0) or 0)))
    except ValueError:
        max_lora = 0
    if not max_lora:  # without the slot count the names say nothing the policy can use
        return 0, (), ()
    return max_lora, _names(labels.get("running_lora_adapters")), _names(labels.get("waiting_lora_adapters"))


class Scraper:
    """GET {engine_url}/metrics -> LoadReport (raises on HTTP or parse failure)."""

    def __init__(self, engine_url: str, *, timeout_s: float = 2.0) -> None:
        self.url = engine_url.rstrip("/") + "/metrics"
        self.timeout_s = timeout_s
        self._session = None

    async def scrape(self) -> LoadReport:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        async with self._session.get(self.url) as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET {self.url}: HTTP {resp.status}")
            text = await resp.text()
        return parse_load(text)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
