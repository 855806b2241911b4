"""The agent's event decoding under malformed input: random bytes, random msgpack, the right
top-level shape with wrong event shapes and field types. Pure part: `decode_payload` either
returns a batch (bad events skipped and counted) or raises `EngineDecodeError`, and the translator
takes whatever the decoder returned without raising. Over real ZMQ: malformed payloads interleaved
with the captured vLLM batches are counted and dropped, the agent keeps running, and its key set
ends equal to the valid batches applied in order."""
from __future__ import annotations

import base64

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replica_agent.decode import EngineDecodeError, EventBatch, decode_payload
from replica_agent.translate import Translator

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                 st.text(max_size=10), st.binary(max_size=40))
value = st.recursive(leaf, lambda ch: st.lists(ch, max_size=5) | st.dictionaries(st.text(max_size=8), ch, max_size=5),
                     max_leaves=20)
hash_like = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=32), value)
stored_map = st.fixed_dictionaries({"type": st.just("BlockStored")}, optional={
    "block_hashes": st.one_of(st.lists(hash_like, max_size=4), value), "parent_block_hash": st.one_of(st.none(), hash_like),
    "token_ids": st.one_of(st.lists(st.integers(-5, 200_000), max_size=64), value),
    "block_size": st.one_of(st.integers(-2, 64), value), "lora_id": value, "medium": st.one_of(st.sampled_from(["GPU", "CPU"]), value),
    "lora_name": st.one_of(st.none(), st.text(max_size=5), value), "extra_keys": st.one_of(st.none(), st.lists(value, max_size=4), value)})
removed_map = st.fixed_dictionaries({"type": st.just("BlockRemoved")}, optional={
    "block_hashes": st.one_of(st.lists(hash_like, max_size=4), value), "medium": value})
array_event = st.one_of(
    st.tuples(st.just("BlockStored"), st.lists(hash_like, max_size=3), st.one_of(st.none(), hash_like),
              st.lists(st.integers(0, 1000), max_size=48), st.one_of(st.integers(0, 32), value), value, value, value, value).map(list),
    st.tuples(st.just("BlockRemoved"), st.one_of(st.lists(hash_like, max_size=3), value), value).map(list),
    st.lists(value, max_size=4))
event = st.one_of(stored_map, removed_map, array_event, st.just({"type": "AllBlocksCleared"}), value)
payload_obj = st.one_of(
    st.tuples(st.one_of(st.floats(), st.integers(-2**63, 2**64 - 1), value), st.lists(event, max_size=6)).map(list),
    st.tuples(st.one_of(st.floats(), value), st.lists(event, max_size=6), value).map(list),
    value)


def _decode_and_translate(payload: bytes, tr: Translator) -> EventBatch | None:
    try:
        batch = decode_payload(payload)
    except EngineDecodeError:
        return None
    tr.apply_all(batch.events)  # what the agent does next: must not raise either
    return batch


@SETTINGS
@given(raw=st.binary(max_size=300))
def test_random_bytes(raw):
    _decode_and_translate(raw, Translator("m", 16))


@SETTINGS
@given(obj=payload_obj)
def test_random_msgpack_shapes(obj):
    tr = Translator("m", 16)
    batch = _decode_and_translate(msgspec.msgpack.encode(obj), tr)
    if batch is not None:
        assert batch.skipped + len(batch.events) == len(obj[1])


@SETTINGS
@given(obj=payload_obj, cut=st.floats(0, 1))
def test_truncated_msgpack(obj, cut):
    raw = msgspec.msgpack.encode(obj)
    _decode_and_translate(raw[: int(len(raw) * cut)], Translator("m", 16))


def test_deeply_nested_msgpack_is_a_decode_error():
    raw = b"\x91" * 100_000 + b"\xc0"  # 100k nested one-element arrays
    with pytest.raises(EngineDecodeError):
        decode_payload(raw)


# ------------------------------------------------------------------------------ over real ZMQ
MALFORMED = [
    b"", b"\xc1", b"not msgpack at all", msgspec.msgpack.encode({"ts": 1}), msgspec.msgpack.encode([1.0]),
    msgspec.msgpack.encode([1.0, "events"]), msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1.5], "token_ids": ["a"], "block_size": "big"}]]),
    msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1, 2], -3, None, 7, 8, 9]]]),
    msgspec.msgpack.encode([1.0, [{"type": "Unknown"}, 5, None, []]]),
    b"\x91" * 5000 + b"\xc0",
]


async def test_malformed_payloads_counted_dropped_agent_keeps_order(vllm_fixture):
    from tests.test_agent_zmq import FakeEngine, expected_keys, index_keys, until

    from gateway.index import KVIndex
    from gateway.index_sync import IndexSync
    from replica_agent.agent import AgentConfig, start_agent
    from replica_agent.feed import open_feed

    import asyncio

    frames = [[base64.b64decode(x) for x in f] for f in vllm_fixture["live_frames"]]
    n = 30
    engine = FakeEngine(frames)
    feed = open_feed("memory://fuzz-decode")
    agent = await start_agent(AgentConfig(replica_id="r1", kv_events_endpoint=engine.pub_ep, replay_endpoint=engine.replay_ep,
                                          model="tiny", block_size=32, snapshot_interval_s=0.2), feed)
    index = KVIndex()
    sync = IndexSync(open_feed("memory://fuzz-decode"), index, block_s=0.05, discover_every_s=0.1)
    task = asyncio.create_task(sync.run())
    try:
        await asyncio.sleep(0.3)
        seq = 0
        for i in range(n):  # each valid batch preceded by a malformed one, every one with its own seq
            await engine.publish(seq, MALFORMED[i % len(MALFORMED)])
            await engine.publish(seq + 1, frames[i][2])
            seq += 2
        await until(lambda: agent.stats.batches + agent.stats.decode_errors >= 2 * n - 3, what="all batches seen")
        assert agent.healthy()
        want = expected_keys([f[2] for f in frames[:n]])
        await until(lambda: set(agent.translator.keys()) == want, what="agent state = valid batches in order")
        await until(lambda: "r1" in index.replicas() and index_keys(index, "r1") == want, what="index converged")
        undecodable = sum(1 for i in range(n) if _undecodable(MALFORMED[i % len(MALFORMED)]))
        assert agent.stats.decode_errors == undecodable
        assert agent.stats.skipped_events >= 1
        assert agent.stream.seq.stats.resyncs == 0  # dropped, not mistaken for gaps
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await agent.close()
        await engine.close()


def _undecodable(p: bytes) -> bool:
    try:
        decode_payload(p)
    except EngineDecodeError:
        return True
    return False
