"""Decoding and translation on the captured real-vLLM frames (pure: no sockets)."""
from __future__ import annotations

import base64

import msgspec
import pytest

from hashing.keys import KeyChain, root_key
from replica_agent.decode import AllBlocksCleared, BlockRemoved, BlockStored, EngineDecodeError, decode_payload
from replica_agent.transport import parse_live_frames, parse_replay_frames
from replica_agent.translate import Cleared, KeysRemoved, KeysStored, Translator

MODEL = "tiny"
BS = 32


def _frames(fx, name="live_frames"):
    return [[base64.b64decode(x) for x in f] for f in fx[name]]


def _batches(fx):
    return [decode_payload(parse_live_frames(f)[2]) for f in _frames(fx)]


def test_live_frames_decode_to_the_counts_in_the_readme(vllm_fixture):
    kinds = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
    seqs = []
    for f in _frames(vllm_fixture):
        topic, seq, payload = parse_live_frames(f)
        assert topic == "kv-events"
        seqs.append(seq)
        for ev in decode_payload(payload).events:
            kinds[type(ev).__name__] += 1
    assert kinds == {"BlockStored": 25, "BlockRemoved": 39, "AllBlocksCleared": 1}
    assert seqs == list(range(len(seqs)))


def test_decoded_fields_match_msgspec_view(vllm_fixture):
    b = _batches(vllm_fixture)[0]
    raw = vllm_fixture["live_decoded"][0]
    ev = b.events[0]
    assert isinstance(ev, BlockStored)
    assert b.ts == raw[0] and b.data_parallel_rank == raw[2]
    assert list(ev.block_hashes) == raw[1][0]["block_hashes"]
    assert ev.parent_block_hash is None and ev.block_size == BS and ev.medium == "GPU" and ev.lora_name is None
    assert len(ev.token_ids) == BS * len(ev.block_hashes)
    assert any(h >= 2**63 for b in _batches(vllm_fixture) for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes)


def test_old_positional_format_and_unknown_fields():
    enc = msgspec.msgpack.encode
    payload = enc([1.5, [
        ["BlockStored", [11, 12], None, list(range(8)), 4, None, "GPU", None],
        ["BlockStored", [13], 12, list(range(8, 12)), 4, None, "CPU", "my-lora", [None], 0, "extra-future-field"],
        ["BlockRemoved", [11], "GPU", 0],
        ["AllBlocksCleared"],
        ["SomethingNew", 1, 2],
        {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU", "future": {"x": 1}},
    ], 0])
    b = decode_payload(payload)
    assert b.skipped == 1
    s1, s2, r, c, r2 = b.events
    assert isinstance(s1, BlockStored) and s1.block_hashes == (11, 12) and s1.block_size == 4
    assert s2.parent_block_hash == 12 and s2.medium == "CPU" and s2.lora_name == "my-lora" and s2.extra_keys == (None,)
    assert isinstance(r, BlockRemoved) and r.block_hashes == (11,)
    assert isinstance(c, AllBlocksCleared)
    assert r2.block_hashes == (b"\x01" * 32,)  # raw digest bytes stay opaque


def test_two_wire_formats_translate_to_the_same_keys():
    toks = list(range(100, 132))
    new = msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                                          "token_ids": toks, "block_size": 16, "lora_id": None, "medium": "GPU",
                                          "lora_name": None, "extra_keys": [["salt-x"], None]}], 0])
    old = msgspec.msgpack.encode([0.0, [["BlockStored", [b"a" * 32, b"b" * 32], None, toks, 16, None, "GPU", None,
                                         [["salt-x"], None]]], 0])
    k_new = Translator("m", 16).apply_all(decode_payload(new).events)
    k_old = Translator("m", 16).apply_all(decode_payload(old).events)
    assert k_new == k_old == [KeysStored("GPU", tuple(KeyChain("m", 16).request_keys(toks, salt="salt-x")))]


def test_garbage_payload_raises_with_reason():
    with pytest.raises(EngineDecodeError):
        decode_payload(b"\xc1\xc1")
    with pytest.raises(EngineDecodeError):
        decode_payload(msgspec.msgpack.encode({"not": "an array"}))


def _tokens(fx, i):
    t = fx["requests"][i]["tokenize"]
    return t["tokens"] if isinstance(t, dict) else t


def test_keys_equal_gateway_keys_including_the_salted_run(vllm_fixture):
    tr = Translator(MODEL, BS)
    recs = [tr.apply_all(b.events) for b in _batches(vllm_fixture)]
    kc = KeyChain(MODEL, BS)
    plain = kc.request_keys(_tokens(vllm_fixture, 0))
    salted = kc.request_keys(_tokens(vllm_fixture, 2), salt="tenant-a")
    assert recs[0] == [KeysStored("GPU", tuple(plain))]
    assert recs[5] == [KeysStored("GPU", tuple(salted))]
    assert not set(plain) & set(salted)  # the salt separates tenants
    # a decode block arrives alone with the prompt's last block as parent: chained from its key
    assert len(recs[1]) == 1 and len(recs[1][0].keys) == 1
    assert tr.stats.unknown_parent_runs == 0


def test_root_is_the_model_root():
    toks = list(range(16))
    ev = BlockStored((7,), None, tuple(toks), 16, "GPU", None, None)
    (rec,) = Translator("m1", 16).apply(ev)
    assert rec.keys == tuple(KeyChain("m1", 16).request_keys(toks))
    assert rec.keys != tuple(KeyChain("m2", 16).request_keys(toks))
    assert root_key("m1") != root_key("m2")


def test_duplicate_stores_are_reference_counted():
    toks = tuple(range(32))
    st = BlockStored((1, 2), None, toks, 16, "GPU", None, None)
    tr = Translator("m", 16)
    (first,) = tr.apply(st)
    assert tr.apply(st) == []  # second store: no new key, one more reference
    assert tr.refcount(1) == 2 and tr.stats.duplicate_stores == 2
    assert tr.apply(BlockRemoved((1, 2), "GPU")) == []  # one reference left: still held
    assert set(tr.keys()) == set(first.keys)
    assert tr.apply(BlockRemoved((1, 2), "GPU")) == [KeysRemoved("GPU", first.keys)]
    assert tr.keys() == ()
    assert tr.apply(BlockRemoved((1,), "GPU")) == [] and tr.stats.unknown_removals == 1


def test_capacity_collapses_report_mode_full_restores(vllm_fixture):
    """The fixture's hit re-reports (request 3, report mode "full") are stored twice and removed once.

    Pure counting leaves 9 stale keys (55 keys on a 48-block engine); with the engine's capacity the
    surplus references collapse and the key set is exactly what the engine holds."""
    counted = Translator(MODEL, BS)
    capped = Translator(MODEL, BS, capacity_blocks={"GPU": 48})
    held: set = set()  # ground truth: a hash is held from its store until its removal
    batches = _batches(vllm_fixture)
    for b in batches[:30]:  # up to the reset
        counted.apply_all(b.events)
        capped.apply_all(b.events)
        for e in b.events:
            if isinstance(e, BlockStored):
                held.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                held.difference_update(e.block_hashes)
    assert len(counted.keys()) == 55
    assert len(capped.keys()) == len(held) == 46 <= 48
    assert capped.stats.collapsed_refs == 9


def test_unknown_parent_is_dropped_and_counted(vllm_fixture):
    tr = Translator(MODEL, BS)
    batches = _batches(vllm_fixture)
    assert tr.apply_all(batches[1].events) == []  # a decode block whose parent we never saw
    assert tr.stats.unknown_parent_runs == 1 and tr.stats.unknown_parent_blocks == 1
    assert tr.keys() == ()


def test_eviction_and_clear(vllm_fixture):
    tr = Translator(MODEL, BS, capacity_blocks={"GPU": 48})
    out = []
    for b in _batches(vllm_fixture):
        out.extend(tr.apply_all(b.events))
    removed = [k for r in out if isinstance(r, KeysRemoved) for k in r.keys]
    assert len(removed) == len(set(removed)) and removed
    i = next(i for i, r in enumerate(out) if isinstance(r, Cleared))
    assert isinstance(out[i + 1], KeysStored)  # the first chat again, after /reset_prefix_cache
    assert set(tr.keys()) == set(out[i + 1].keys)
    assert tuple(KeyChain(MODEL, BS).request_keys(_tokens(vllm_fixture, 10))) == out[i + 1].keys


def test_lora_and_unmodelled_extras():
    toks = tuple(range(32))
    kc = KeyChain("m", 16)
    (r,) = Translator("m", 16).apply(BlockStored((1, 2), None, toks, 16, "GPU", "ad1", (("ad1", "s"), ("ad1",))))
    assert r.keys == tuple(kc.request_keys(toks, salt="s", lora="ad1"))
    (r2,) = Translator("m", 16).apply(BlockStored((1, 2), None, toks, 16, "GPU", None, (None, (("mm", 5),))))
    assert r2.keys[0] == kc.request_keys(toks)[0] and r2.keys[1] != kc.request_keys(toks)[1]


def test_replay_frames_parse(vllm_fixture):
    frames = _frames(vllm_fixture, "replay_frames")
    parsed = [parse_replay_frames(f) for f in frames]
    assert parsed[-1] is None and all(p is not None for p in parsed[:-1])
    live = [parse_live_frames(f) for f in _frames(vllm_fixture)]
    assert [p[1] for p in parsed[:-1]] == [p[1] for p in live]
    assert [p[2] for p in parsed[:-1]] == [p[2] for p in live]
    # older engines: no topic frame
    assert parse_replay_frames([b"", (5).to_bytes(8, "big"), b"x"]) == ("", 5, b"x")
    assert parse_replay_frames([b"", b"\xff" * 8, b""]) is None


def test_pure_modules_import_no_io_libraries():
    import subprocess
    import sys

    code = ("import sys; import replica_agent.decode, replica_agent.translate, gateway.index, replica_agent.feed.records; "
            "bad = [m for m in ('zmq', 'redis', 'aiohttp', 'asyncio') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_adjacent_removals_become_one_feed_record_and_order_is_kept():
    from replica_agent.agent import _feed_drafts
    from replica_agent.translate import Cleared, KeysRemoved, KeysStored

    recs = [KeysRemoved("GPU", (1,)), KeysRemoved("GPU", (2,)), KeysRemoved("CPU", (3,)), KeysStored("GPU", (4, 5)),
            KeysRemoved("GPU", (4,)), KeysRemoved("GPU", (6,)), Cleared(), KeysRemoved("GPU", (7,))]
    got = [(d.kind, d.medium, d.keys) for d in _feed_drafts("r", recs)]
    assert got == [("removed", "GPU", (1, 2)), ("removed", "CPU", (3,)), ("stored", "GPU", (4, 5)),
                   ("removed", "GPU", (4, 6)), ("cleared", "GPU", ()), ("removed", "GPU", (7,))]
