"""The simulated replica's configuration (`SimConfig`: the engine's shape, its time model, KV
events, faults at start) and how `warmroute sim`'s flags map onto it (`config_from_args`)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from loadtests.sim.blockpool import DEFAULT_KV_BUDGET_BYTES, LLAMA3_8B, ModelShape
from loadtests.sim.scheduler import EngineConfig, TimeModel

__all__ = ["SimConfig", "config_from_args"]


@dataclass
class SimConfig:
    model: str = "warmroute-sim"  # served model name
    tokenizer: str | None = None  # HF tokenizer dir; None: gateway.default_tokenizer
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV capacity; None: from model_shape and kv_budget_bytes
    model_shape: ModelShape = LLAMA3_8B  # for capacity when num_blocks is None
    kv_budget_bytes: int = DEFAULT_KV_BUDGET_BYTES  # for capacity when num_blocks is None
    max_model_len: int = 32768  # prompt + output tokens per request at most (clamped to KV capacity)
    max_num_seqs: int = 256  # running sequences at most
    max_num_batched_tokens: int = 8192  # per-step token budget (chunked prefill)
    hash_algo: str = "sha256_cbor"  # prefix-caching hash algo (engine-exact)
    enable_prefix_caching: bool = True  # vLLM's --enable-prefix-caching
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy: "fcfs" or "priority"
    time: TimeModel = field(default_factory=TimeModel)  # step-time model (GPU profile by default)
    default_max_tokens: int = 16  # when a request gives no max_tokens
    kv_events_endpoint: str | None = None  # ZMQ PUB endpoint; None: no events
    replay_endpoint: str | None = None  # ZMQ ROUTER replay endpoint; None: no replay
    kv_events_topic: str = "kv-events"  # ZMQ topic frame
    kv_events_buffer_steps: int = 10000  # batches kept for replay
    events_format: str = "map"  # "map" (current vLLM) or "array" (older positional)
    engine_label: str = "0"  # Prometheus label `engine`
    data_parallel_rank: int = 0  # in event payloads and /kv_event_sources
    drop_events_fraction: float = 0.0  # fault at start: share of event batches dropped
    slow_factor: float = 1.0  # fault at start: step times multiplied
    crash_after_s: float | None = None  # fault: crash this long after start
    stall_after_s: float | None = None  # fault: stall this long after start ...
    stall_s: float = 0.0  # ... for this long
    trace: bool = False  # keep per-request and per-step timelines for GET /sim/trace (diagnostics)
    lora_modules: tuple[str, ...] = ()  # LoRA adapters served besides the model (vLLM --lora-modules names)
    max_loras: int = 1  # adapters one batch may run (vLLM --max-loras; its default is 1), with lora_modules
    lora_metrics: bool = True  # export vllm:lora_requests_info (False: as an engine whose slots are not visible)
    responses_store: bool = False  # keep answered Responses (vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1: loadtests/sim/responses.py)
    multimodal: bool = False  # serve image / audio / video parts as a multi-modal model (openai_requests.chat_messages)
    media_tokens: int = 0  # with multimodal: each item's placeholder takes this many tokens more

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            model_shape=self.model_shape,
            kv_budget_bytes=self.kv_budget_bytes,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            hash_algo=self.hash_algo,
            enable_prefix_caching=self.enable_prefix_caching,
            scheduling_policy=self.scheduling_policy,
            max_loras=self.max_loras if self.lora_modules else 0,
            time=replace(self.time),
        )


def config_from_args(args: Any) -> SimConfig:
    g = lambda name, default=None: getattr(args, name, default)  # noqa: E731 - tolerate older arg sets
    profile = g("time_profile", "gpu")
    tm = TimeModel.wallclock() if profile == "wallclock" else TimeModel()
    if g("step_overhead_ms") is not None:
        tm.step_overhead_s = g("step_overhead_ms") / 1000.0
    if g("prefill_ms_per_token") is not None:
        tm.prefill_s_per_token = g("prefill_ms_per_token") / 1000.0
    if g("decode_ms_per_seq") is not None:
        tm.decode_s_per_seq = g("decode_ms_per_seq") / 1000.0
    tm.time_scale = g("time_scale", 1.0) or 1.0
    return SimConfig(
        model=g("model", "warmroute-sim"),
        tokenizer=g("tokenizer"),
        block_size=g("block_size", 16),
        num_blocks=g("num_blocks"),
        kv_budget_bytes=int((g("kv_budget_gib") or DEFAULT_KV_BUDGET_BYTES / 1024**3) * 1024**3),
        max_model_len=g("max_model_len", 32768),
        max_num_seqs=g("max_num_seqs", 256) or 256,
        max_num_batched_tokens=g("max_num_batched_tokens", 8192) or 8192,
        hash_algo=g("hash_algo", "sha256_cbor"),
        scheduling_policy=g("scheduling_policy", "fcfs") or "fcfs",
        time=tm,
        default_max_tokens=g("default_max_tokens", 16) or 16,
        kv_events_endpoint=g("kv_events_endpoint"),
        replay_endpoint=g("replay_endpoint"),
        kv_events_topic=g("kv_events_topic", "kv-events") or "",
        events_format=g("events_format", "map") or "map",
        drop_events_fraction=g("fault_drop_events", 0.0) or 0.0,
        slow_factor=g("fault_slow", 1.0) or 1.0,
        crash_after_s=g("fault_crash_after_s"),
        stall_after_s=g("fault_stall_after_s"),
        stall_s=g("fault_stall_s", 0.0) or 0.0,
        lora_modules=tuple(n for n in (g("lora_modules") or "").split(",") if n),
        max_loras=g("max_loras", 1) or 1,
        lora_metrics=not g("no_lora_metrics", False),
        responses_store=bool(g("responses_store", False)),
        multimodal=bool(g("multimodal", False)),
        media_tokens=g("media_tokens", 0) or 0,
    )
