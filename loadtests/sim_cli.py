"""Flags of `warmroute sim` (DESIGN.md "Operating it"); the simulator lives in loadtests.sim."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="warmroute-sim", help="served model name")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="HF tokenizer directory (default: built-in Qwen/ChatML)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV capacity in blocks (default: from the model shape and KV budget)")
    p.add_argument("--kv-budget-gib", type=float, default=None, help="KV memory budget for --num-blocks' default (40 GiB; Llama-3-8B shape)")
    p.add_argument("--kv-events-endpoint", default=None, metavar="EP", help="ZMQ PUB endpoint (binds if it has * or ::, else connects)")
    p.add_argument("--replay-endpoint", default=None, metavar="EP", help="ZMQ ROUTER replay endpoint (always binds)")
    p.add_argument("--kv-events-topic", default="kv-events", help="ZMQ topic frame of KV events")
    p.add_argument("--events-format", default="map", choices=["map", "array"], help="KV event encoding: current maps or older positional arrays")
    p.add_argument("--hash-algo", default="sha256_cbor", choices=["sha256", "sha256_cbor"])
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--max-num-seqs", type=int, default=256, help="running sequences at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens scheduled per step at most (chunked prefill)")
    p.add_argument("--default-max-tokens", type=int, default=16, help="output tokens when a request gives no max_tokens")
    t = p.add_argument_group("time model (step = overhead + prefill tokens x per-token + decoding seqs x per-seq, x time scale)")
    t.add_argument("--time-profile", default="gpu", choices=["gpu", "wallclock"],
                   help="gpu: Llama-3-8B on an A100 (8 ms + 0.05 ms/token + 0.25 ms/seq); wallclock: 12 ms + 1 ms/token + 0.1 ms/seq")
    t.add_argument("--step-overhead-ms", type=float, default=None)
    t.add_argument("--prefill-ms-per-token", type=float, default=None)
    t.add_argument("--decode-ms-per-seq", type=float, default=None)
    t.add_argument("--time-scale", type=float, default=1.0, help="multiplies every step time")
    f = p.add_argument_group("faults (also at run time: POST /sim/fault {\"kind\": crash|stall|drop_events|restart|slow|recover|clear})")
    f.add_argument("--fault-drop-events", type=float, default=0.0, metavar="FRACTION", help="drop this share of KV-event batches (seq gaps)")
    f.add_argument("--fault-slow", type=float, default=1.0, metavar="FACTOR", help="multiply step times")
    f.add_argument("--fault-crash-after-s", type=float, default=None, metavar="S", help="crash (health 503, 500s) after S seconds")
    f.add_argument("--fault-stall-after-s", type=float, default=None, metavar="S", help="stall after S seconds ...")
    f.add_argument("--fault-stall-s", type=float, default=0.0, metavar="S", help="... for S seconds")

