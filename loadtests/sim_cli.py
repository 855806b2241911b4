"""Flags of `warmroute sim`; the simulator itself lives in loadtests.sim."""
from __future__ import annotations

import argparse
import os

DESCRIPTION = """\
One simulated vLLM replica: vLLM's OpenAI routes (SSE streaming, usage with cached tokens),
/tokenize, /health, /v1/models, /metrics with vLLM's names, a paged KV cache with prefix caching,
continuous batching, and KV-cache events over ZMQ as vLLM publishes them. Faults can be injected
at start (flags below) or at run time (POST /sim/fault)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="listen address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--model", default="warmroute-sim", help="served model name")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="HF tokenizer directory (default: the built-in Qwen/ChatML one)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV capacity in blocks (default: from the Llama-3-8B shape and --kv-budget-gib)")
    p.add_argument("--kv-budget-gib", type=float, default=None,
                   help="KV memory budget that sizes --num-blocks' default (default: 40 GiB)")
    p.add_argument("--kv-events-endpoint", default=None, metavar="EP",
                   help="ZMQ PUB endpoint; binds if it has * or ::, else connects (default: none, no events)")
    p.add_argument("--replay-endpoint", default=None, metavar="EP", help="ZMQ ROUTER replay endpoint, always binds (default: none)")
    p.add_argument("--kv-events-topic", default="kv-events", help="ZMQ topic frame of KV events")
    p.add_argument("--events-format", default="map", choices=["map", "array"], help="KV event encoding: current maps or older positional arrays")
    p.add_argument("--hash-algo", default="sha256_cbor", choices=["sha256", "sha256_cbor"], help="prefix-caching hash, as vLLM's --prefix-caching-hash-algo")
    p.add_argument("--max-model-len", type=int, default=32768, help="prompt + output tokens per request at most (clamped to the KV capacity)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="running sequences at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens scheduled per step at most (chunked prefill)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="vLLM's --scheduling-policy: fcfs, or priority (a request's `priority`, lower first)")
    p.add_argument("--default-max-tokens", type=int, default=16, help="output tokens when a request gives no max_tokens")
    p.add_argument("--lora-modules", default="", metavar="NAMES",
                   help="LoRA adapters served besides the model, comma-separated names (vLLM's --lora-modules; no weights; default: none)")
    p.add_argument("--max-loras", type=int, default=1, help="adapters one batch may run, as vLLM's --max-loras (default 1)")
    p.add_argument("--no-lora-metrics", action="store_true",
                   help="leave vllm:lora_requests_info out of /metrics (an engine whose LoRA slots a router cannot see)")
    p.add_argument("--responses-store", action="store_true",
                   default=os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "") not in ("", "0"),
                   help="keep answered Responses for previous_response_id, background responses and GET / cancel by id, as vLLM with "
                        "VLLM_ENABLE_RESPONSES_API_STORE=1 (default: that variable's value, else off)")
    p.add_argument("--multimodal", action="store_true",
                   help="serve image, audio and video content parts as a multi-modal model: each item a placeholder keyed by "
                        "its content, first in its message (default: off, refused as a text-only model does)")
    p.add_argument("--media-tokens", type=int, default=0,
                   help="with --multimodal, the tokens each item's placeholder takes past its digest, as a model's "
                        "processor expands an image into hundreds (default: 0)")
    t = p.add_argument_group("time model (step = overhead + prefill tokens x per-token + decoding seqs x per-seq, x time scale)")
    t.add_argument("--time-profile", default="gpu", choices=["gpu", "wallclock"],
                   help="gpu: Llama-3-8B on an A100 (8 ms + 0.05 ms/token + 0.25 ms/seq); wallclock: 12 ms + 1 ms/token + 0.1 ms/seq")
    t.add_argument("--step-overhead-ms", type=float, default=None, help="fixed cost of a step (default: the profile's)")
    t.add_argument("--prefill-ms-per-token", type=float, default=None, help="prefill cost per token (default: the profile's)")
    t.add_argument("--decode-ms-per-seq", type=float, default=None, help="decode cost per running sequence (default: the profile's)")
    t.add_argument("--time-scale", type=float, default=1.0, help="multiplies every step time")
    f = p.add_argument_group("faults (also at run time: POST /sim/fault {\"kind\": crash|stall|drop_events|restart|slow|recover|clear})")
    f.add_argument("--fault-drop-events", type=float, default=0.0, metavar="FRACTION", help="drop this share of KV-event batches (seq gaps)")
    f.add_argument("--fault-slow", type=float, default=1.0, metavar="FACTOR", help="multiply step times")
    f.add_argument("--fault-crash-after-s", type=float, default=None, metavar="S",
                   help="crash (health 503, 500s) after S seconds (default: never)")
    f.add_argument("--fault-stall-after-s", type=float, default=None, metavar="S",
                   help="stall after S seconds ... (default: never)")
    f.add_argument("--fault-stall-s", type=float, default=0.0, metavar="S", help="... for S seconds")

