"""hashing/: engine-exact vLLM hashes against published vectors and captured real-vLLM events;
warmroute keys' properties (hypothesis)."""
from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from hashing import KeyChain, block_extras, chain_keys, root_key
from hashing import vllm_hash


def test_engine_vectors_published_by_vllm():
    toks = list(range(16))
    assert vllm_hash.none_hash("sha256", "vllm-none-hash").hex() == "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
    assert vllm_hash.none_hash("sha256_cbor", "vllm-none-hash").hex() == "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
    assert vllm_hash.event_int(vllm_hash.block_hashes(toks, 16, "sha256", seed="vllm-none-hash")[0]) == 3262291359910021016
    assert vllm_hash.event_int(vllm_hash.block_hashes(toks, 16, "sha256_cbor", seed="vllm-none-hash")[0]) == 2233398808101521225


def _stored(vllm_fixture):
    return [e for batch in vllm_fixture["live_decoded"] for e in batch[1] if e["type"] == "BlockStored"]


def test_engine_hashes_equal_real_vllm_events(vllm_fixture):
    """Every prompt run the real engine stored (parent nil) rehashes to the same ints, salted included."""
    checked = salted = 0
    for ev in _stored(vllm_fixture):
        if ev["parent_block_hash"] is not None:
            continue
        salt = None
        if ev.get("extra_keys") and ev["extra_keys"][0]:
            salt = ev["extra_keys"][0][0]
            salted += 1
        got = vllm_hash.block_hashes(ev["token_ids"], ev["block_size"], "sha256", cache_salt=salt, seed="vllm-none-hash")
        assert [vllm_hash.event_int(h) for h in got] == ev["block_hashes"]
        checked += 1
    assert checked >= 5 and salted >= 1


def test_key_layout_is_documented_bytes():
    import struct

    import xxhash

    root = root_key("m")
    assert root == xxhash.xxh3_64_intdigest(b"warmroute/root/v1\x00m")
    toks = list(range(4))
    salt_part = b"\x01" + struct.pack("<H", 1) + b"s"
    expect = xxhash.xxh3_64_intdigest(root.to_bytes(8, "little") + struct.pack("<4I", *toks) + salt_part)
    assert KeyChain("m", 4).request_keys(toks, salt="s") == [expect]


tokens = st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=0, max_size=200)


@settings(max_examples=200, deadline=None)
@given(toks=tokens, extra=st.lists(st.integers(0, 2**32 - 1), max_size=40), bs=st.integers(1, 17))
def test_prefix_keys_are_prefix(toks, extra, bs):
    kc = KeyChain("model", bs)
    a = kc.request_keys(toks, salt="t")
    b = kc.request_keys(toks + extra, salt="t")
    assert b[: len(a)] == a
    assert len(a) == len(toks) // bs  # partial blocks never produce a key


@settings(max_examples=200, deadline=None)
@given(toks=st.lists(st.integers(0, 150000), min_size=1, max_size=200), bs=st.integers(1, 17), data=st.data())
def test_changing_block_i_changes_keys_from_i(toks, bs, data):
    kc = KeyChain("model", bs)
    n = len(toks) // bs
    if n == 0:
        return
    pos = data.draw(st.integers(0, n * bs - 1))
    changed = list(toks)
    changed[pos] = toks[pos] + 1
    a, b = kc.request_keys(toks), kc.request_keys(changed)
    i = pos // bs
    assert a[:i] == b[:i]
    assert all(x != y for x, y in zip(a[i:], b[i:]))


@settings(max_examples=100, deadline=None)
@given(toks=st.lists(st.integers(0, 150000), min_size=8, max_size=100))
def test_salt_and_lora_change_every_key(toks):
    kc = KeyChain("model", 4)
    base = kc.request_keys(toks)
    for other in (kc.request_keys(toks, salt="a"), kc.request_keys(toks, salt="b"), kc.request_keys(toks, lora="x")):
        assert all(x != y for x, y in zip(base, other))
    assert set(kc.request_keys(toks, salt="a")).isdisjoint(kc.request_keys(toks, salt="b"))


def test_continuing_a_chain_equals_whole_request():
    """The agent rebuilds keys run by run (parent from an earlier event); same keys as the gateway's."""
    kc = KeyChain("model", 4)
    toks = list(range(40))
    whole = kc.request_keys(toks, salt="s", lora="l")
    first, rest = block_extras("s", "l")
    head = chain_keys(kc.root, toks[:12], 4, first, rest)
    tail = chain_keys(head[-1], toks[12:], 4, rest, rest)
    assert head + tail == whole


def test_model_root_differs():
    assert KeyChain("a", 4).request_keys(list(range(8))) != KeyChain("b", 4).request_keys(list(range(8)))
