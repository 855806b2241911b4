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
    p.add_argument("--kv-events-endpoint", default=None, metavar="EP", help="ZMQ PUB endpoint (binds if it has * or ::, else connects)")
    p.add_argument("--replay-endpoint", default=None, metavar="EP", help="ZMQ ROUTER replay endpoint (always binds)")
    p.add_argument("--hash-algo", default="sha256_cbor", choices=["sha256", "sha256_cbor"])
    p.add_argument("--max-model-len", type=int, default=32768)


def run(args: argparse.Namespace) -> int:
    from loadtests.sim.server import main_from_args

    return main_from_args(args)
