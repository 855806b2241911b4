"""What the simulated replica reports about itself: vLLM's Prometheus metrics (the gauges and
counters the agent scrapes, the cache config, the TTFT histogram) and the simulator's own fidelity
figures (steps run, modelled against measured step seconds, how late the step timers fired), for
`/metrics` and `/sim/stats`."""
from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loadtests.sim.config import SimConfig
    from loadtests.sim.scheduler import SimEngine

__all__ = ["SimMetrics", "TTFT_BUCKETS_S"]

# vLLM's TTFT histogram buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class SimMetrics:
    """One replica's TTFT histogram and step-timing figures."""

    def __init__(self) -> None:
        self.steps = 0
        self.modelled_s_total = 0.0
        self.actual_s_total = 0.0
        self.lateness_max_s = 0.0
        self.recent_lateness_s: deque[float] = deque(maxlen=20000)
        self.ttft_bucket_counts = [0] * (len(TTFT_BUCKETS_S) + 1)
        self.ttft_sum_s = 0.0
        self.ttft_count = 0
        self.lora_series: dict[tuple[int, str, str], float] = {}  # vllm:lora_requests_info's label sets -> last time

    def observe_step(self, modelled_s: float, actual_s: float, lateness_s: float) -> None:
        self.steps += 1
        self.modelled_s_total += modelled_s
        self.actual_s_total += actual_s
        if lateness_s > self.lateness_max_s:
            self.lateness_max_s = lateness_s
        self.recent_lateness_s.append(lateness_s)

    def observe_ttft(self, ttft_s: float) -> None:
        self.ttft_sum_s += ttft_s
        self.ttft_count += 1
        for i, b in enumerate(TTFT_BUCKETS_S):
            if ttft_s <= b:
                self.ttft_bucket_counts[i] += 1
                return
        self.ttft_bucket_counts[-1] += 1

    def timing(self) -> dict:
        """The step-timing part of `/sim/stats`."""
        lat = sorted(self.recent_lateness_s)

        def pct(q: float) -> float:
            return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else 0.0

        return {
            "steps": self.steps,
            "modelled_s_total": self.modelled_s_total,
            "actual_s_total": self.actual_s_total,
            "lateness_s": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": self.lateness_max_s},
        }

    def _lora_info(self, eng: SimEngine, cfg: SimConfig) -> str:
        """vllm:lora_requests_info as vLLM writes it: one series per label set ever seen, each set to
        the time it was last the engine's state (so the newest series is the state now)."""
        running, waiting = eng.lora_adapters()
        key = (cfg.max_loras, ",".join(running), ",".join(waiting))
        self.lora_series[key] = max(time.time(), max(self.lora_series.values(), default=0.0) + 1e-6)
        name = "vllm:lora_requests_info"
        lines = [f"# HELP {name} Running stats on lora requests.\n# TYPE {name} gauge\n"]
        for (max_lora, run, wait), t in self.lora_series.items():
            lines.append(f'{name}{{max_lora="{max_lora}",running_lora_adapters="{run}",waiting_lora_adapters="{wait}"}} {t!r}\n')
        return "".join(lines)

    def prometheus_text(self, eng: SimEngine, cfg: SimConfig) -> str:
        lbl = f'engine="{cfg.engine_label}",model_name="{cfg.model}"'
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, value: float) -> None:
            out.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name}{{{lbl}}} {float(value)}\n")

        metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", eng.num_running)
        metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", eng.num_waiting)
        metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", eng.pool.usage)
        metric("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.", eng.prefix_cache_queries_tokens_total)
        metric("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", eng.prefix_cache_hits_tokens_total)
        metric("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", eng.num_preemptions_total)
        metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", eng.num_prompt_tokens_total)
        metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", eng.num_generation_tokens_total)
        info = (f'block_size="{cfg.block_size}",cache_dtype="auto",enable_prefix_caching="{cfg.enable_prefix_caching}",'
                f'engine="{cfg.engine_label}",gpu_memory_utilization="0.9",model_name="{cfg.model}",'
                f'num_cpu_blocks="None",num_gpu_blocks="{eng.pool.num_blocks}",prefix_caching_hash_algo="{cfg.hash_algo}"')
        out.append(f"# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{{info}}} 1.0\n")
        if cfg.lora_modules and cfg.lora_metrics:
            out.append(self._lora_info(eng, cfg))
        name = "vllm:time_to_first_token_seconds"
        lines = [f"# HELP {name} Histogram of time to first token in seconds.\n# TYPE {name} histogram\n"]
        cum = 0
        for b, c in zip(TTFT_BUCKETS_S, self.ttft_bucket_counts):
            cum += c
            lines.append(f'{name}_bucket{{{lbl},le="{b}"}} {float(cum)}\n')
        cum += self.ttft_bucket_counts[-1]
        lines.append(f'{name}_bucket{{{lbl},le="+Inf"}} {float(cum)}\n{name}_count{{{lbl}}} {float(cum)}\n{name}_sum{{{lbl}}} {self.ttft_sum_s}\n')
        out.append("".join(lines))
        # the simulator's own fidelity figures (not vLLM metrics)
        metric("warmroute_sim_steps_total", "counter", "Engine steps run.", self.steps)
        metric("warmroute_sim_step_modelled_seconds_total", "counter", "Sum of modelled step durations.", self.modelled_s_total)
        metric("warmroute_sim_step_actual_seconds_total", "counter", "Sum of measured step durations.", self.actual_s_total)
        metric("warmroute_sim_step_lateness_max_seconds", "gauge", "Largest timer lateness of a step.", self.lateness_max_s)
        return "".join(out)
