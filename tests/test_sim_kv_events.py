"""The simulator's KV events over real ZMQ, decoded by a plain subscriber (raw pyzmq + msgspec, no
project decoding code): vLLM's frames, map format, engine-exact hashes, evictions, salts, report
mode "full", clearing, replay, and dropped batches showing as seq gaps."""
from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from hashing import vllm_hash
from loadtests.sim.blockpool import AllBlocksCleared, BlockRemoved, BlockStored
from loadtests.sim.kv_events import encode_batch, endpoint_binds
from loadtests.sim.scheduler import TimeModel
from loadtests.sim.server import SimConfig, start_sim_server
from tests.conftest import free_port

BS = 16
FAST = TimeModel(step_overhead_s=0.001, prefill_s_per_token=1e-5, decode_s_per_seq=1e-5)


def test_bind_or_connect_rule() -> None:
    assert endpoint_binds("tcp://*:5557") and endpoint_binds("tcp://[::]:5557") and endpoint_binds("ipc:///tmp/x")
    assert endpoint_binds("inproc://x")
    assert not endpoint_binds("tcp://127.0.0.1:5557") and not endpoint_binds("tcp://router.svc:5557")


def test_array_format_and_map_format_shapes(vllm_fixture) -> None:
    h = [bytes(24) + (5).to_bytes(8, "big")]
    ev = [BlockRemoved(h), BlockStored(h, None, list(range(16)), 16, [["s"]]), AllBlocksCleared()]
    ts, arr, dp = msgspec.msgpack.decode(encode_batch(ev, 1.5, 0, "array"))
    assert (ts, dp) == (1.5, 0)
    assert arr[0] == ["BlockRemoved", [5], "GPU"]
    assert arr[1] == ["BlockStored", [5], None, list(range(16)), 16, None, "GPU", None, [["s"]]]
    assert arr[2] == ["AllBlocksCleared"]
    _, maps, _ = msgspec.msgpack.decode(encode_batch(ev, 1.5, 0, "map"))
    # same keys, in the same order, as the real engine's events in the captured fixture
    real = {e["type"]: list(e) for _, evs, _ in vllm_fixture["live_decoded"] for e in evs}
    assert [list(m) for m in maps] == [real["BlockRemoved"], real["BlockStored"], real["AllBlocksCleared"]]


class Sub:
    """A bare subscriber that binds (the sim's endpoint has a concrete host, so the sim connects).
    It receives continuously from the start: a bound SUB only sends its subscription to a newly
    connected PUB while its own socket is in use, so an idle one loses the first batches."""

    def __init__(self, ctx: zmq.asyncio.Context, port: int) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.seen: list[tuple[int, bytes, list]] = []
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            await self.queue.put(frames)

    async def recv(self, timeout_s: float = 3.0) -> tuple[int, list]:
        topic, seq8, payload = await asyncio.wait_for(self.queue.get(), timeout_s)
        assert topic == b"kv-events" and len(seq8) == 8
        seq = int.from_bytes(seq8, "big")
        ts, events, dp = msgspec.msgpack.decode(payload)
        assert isinstance(ts, float) and dp == 0
        self.seen.append((seq, payload, events))
        return seq, events

    async def drain(self, quiet_s: float = 0.3) -> list[tuple[int, list]]:
        out = []
        while True:
            try:
                out.append(await self.recv(quiet_s))
            except asyncio.TimeoutError:
                return out

    async def close(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass
        self.sock.close(0)


async def test_events_hashes_evictions_replay_and_gaps(tokenizer_dir) -> None:
    pub_port, replay_port = free_port(), free_port()
    ctx = zmq.asyncio.Context()
    sub = Sub(ctx, pub_port)
    sim = await start_sim_server(SimConfig(
        model="m", tokenizer=str(tokenizer_dir), block_size=BS, num_blocks=12, time=FAST, max_model_len=192,
        kv_events_endpoint=f"tcp://127.0.0.1:{pub_port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
    ))
    http = aiohttp.ClientSession()

    async def complete(prompt, **kw):
        async with http.post(sim.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, **kw}) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["usage"]

    try:
        async with http.get(sim.url + "/kv_event_sources") as r:
            assert await r.json() == [{"data_parallel_rank": 0, "endpoint": f"tcp://127.0.0.1:{pub_port}",
                                       "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": "kv-events"}]
        await asyncio.sleep(0.5)  # a connecting PUB needs its handshake before sends reach the peer
        base = list(range(40))  # tokens 0..15 are vLLM's hash vector's first block
        await complete(base)
        seq, events = await sub.recv()
        assert seq == 0 and len(events) == 1
        ev = events[0]
        assert list(ev)[0] == "type" and ev["type"] == "BlockStored"
        assert ev["block_hashes"][0] == 2233398808101521225
        assert ev["block_hashes"] == [vllm_hash.event_int(h) for h in vllm_hash.block_hashes(base, BS, "sha256_cbor")]
        assert ev["parent_block_hash"] is None and ev["token_ids"] == base[:32] and ev["block_size"] == BS
        assert ev["extra_keys"] == [None, None] and ev["medium"] == "GPU"
        stored = set(ev["block_hashes"])

        # a hit emits nothing; with report mode "full" the hit blocks are re-reported from block 0
        assert (await complete(base))["prompt_tokens_details"]["cached_tokens"] == 32
        assert await sub.drain(0.2) == []
        await complete(base, vllm_xargs={"kv_cache_report_mode": "full"})
        (_, events), = await sub.drain(0.3)
        assert [e["block_hashes"] for e in events] == [ev["block_hashes"]] and events[0]["parent_block_hash"] is None

        # a salted request: the salt is in block 0's extra keys and in the hashes
        await complete(base, cache_salt="tenant-a")
        (_, events), = await sub.drain(0.3)
        assert events[0]["extra_keys"] == [["tenant-a"], None]
        assert events[0]["block_hashes"] == [vllm_hash.event_int(h) for h in vllm_hash.block_hashes(base, BS, "sha256_cbor", cache_salt="tenant-a")]
        stored |= set(events[0]["block_hashes"])

        # fill the 12-block pool with other prompts: LRU evictions arrive as BlockRemoved of stored hashes
        for i in range(3):
            await complete(list(range(1000 * (i + 1), 1000 * (i + 1) + 64)))
        batches = await sub.drain(0.3)
        removed = [h for _, evs in batches for e in evs if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        assert removed and set(removed) <= stored | {h for _, evs in batches for e in evs if e["type"] == "BlockStored" for h in e["block_hashes"]}
        assert set(removed) & stored
        assert all(len(e["block_hashes"]) == 1 for _, evs in batches for e in evs if e["type"] == "BlockRemoved")

        # reset_prefix_cache: AllBlocksCleared
        async with http.post(sim.url + "/reset_prefix_cache") as r:
            assert r.status == 200
        (_, events), = await sub.drain(0.3)
        assert events == [{"type": "AllBlocksCleared"}]

        live_seqs = [s for s, _, _ in sub.seen]
        assert live_seqs == list(range(len(live_seqs)))  # no gap so far

        # replay from seq 2: every retained batch >= 2, byte-identical, then the end marker
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        await dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        replayed = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 3)
            if frames == [b"", b"", b"\xff" * 8, b""]:
                break
            assert len(frames) == 4 and frames[0] == b"" and frames[1] == b"kv-events"
            replayed.append((int.from_bytes(frames[2], "big"), frames[3]))
        dealer.close()
        assert replayed == [(s, p) for s, p, _ in sub.seen if s >= 2]

        # drop every batch for one request: its seq is consumed, the next batch shows the gap
        async with http.post(sim.url + "/sim/fault", json={"kind": "drop_events", "fraction": 1.0}) as r:
            assert r.status == 200
        await complete(list(range(5000, 5040)))
        assert await sub.drain(0.2) == []
        async with http.post(sim.url + "/sim/fault", json={"kind": "clear"}) as r:
            assert r.status == 200
        await complete(list(range(6000, 6040)))
        batches = await sub.drain(0.3)
        assert batches[0][0] >= live_seqs[-1] + 2

        # restart: seq back to 0, cache empty
        async with http.post(sim.url + "/sim/fault", json={"kind": "restart"}) as r:
            assert r.status == 200
        assert (await complete(base))["prompt_tokens_details"]["cached_tokens"] == 0
        (seq, events), = await sub.drain(0.3)
        assert seq == 0 and events[0]["block_hashes"][0] == 2233398808101521225
    finally:
        await http.close()
        await sim.close()
        await sub.close()
        ctx.term()
