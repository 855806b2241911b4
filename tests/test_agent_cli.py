"""`warmroute agent` as its own process: flags, admin port, Redis feed, clean exit on SIGTERM."""
from __future__ import annotations

import asyncio
import base64
import json
import signal
import subprocess
import sys
import urllib.request

import pytest
import zmq
import zmq.asyncio

from gateway.index import KVIndex
from gateway.index_sync import IndexSync
from hashing.keys import KeyChain
from replica_agent.feed import open_feed
from tests.conftest import REPO, free_port

pytestmark = pytest.mark.redis


async def test_agent_process_publishes_and_stops_cleanly(vllm_fixture, redis_server):
    frames = [[base64.b64decode(x) for x in f] for f in vllm_fixture["live_frames"]]
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub_ep = f"tcp://127.0.0.1:{free_port()}"
    pub.bind(pub_ep)
    admin = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "agent", "--replica-id", "cli-r", "--engine-url", f"http://127.0.0.1:{free_port()}",
         "--kv-events-endpoint", pub_ep, "--feed", redis_server.url, "--model", "tiny", "--block-size", "32",
         "--admin-port", str(admin), "--load-interval", "0.5"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        health = None
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/healthz", timeout=1) as r:
                    health = json.loads(r.read())
                    break
            except OSError:
                await asyncio.sleep(0.1)
        assert health and health["ok"] and health["model"] == "tiny", health
        await asyncio.sleep(0.3)  # subscription handshake
        for i in range(6):  # first chat, decode blocks, the salted run (no replay endpoint: none lost here)
            await pub.send_multipart([frames[i][0], i.to_bytes(8, "big"), frames[i][2]])
            await asyncio.sleep(0.01)
        index = KVIndex()
        sync = IndexSync(open_feed(redis_server.url), index, block_s=0.05)
        toks = vllm_fixture["requests"][2]["tokenize"]
        toks = toks["tokens"] if isinstance(toks, dict) else toks
        salted = KeyChain("tiny", 32).request_keys(toks, salt="tenant-a")
        for _ in range(100):
            await sync.step()
            if index.match(salted).get("cli-r"):
                break
        assert index.match(salted)["cli-r"].gpu_blocks == len(salted) == 9
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=2) as r:
            text = r.read().decode()
        assert 'warmroute_agent_batches_total{replica="cli-r"} 6.0' in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pub.close(0)
        ctx.term()
