"""Smoke tests against 2 real vLLM (CPU build) replicas: the facts the rest of warmroute relies on
(tokenization, hashing, events, metrics) hold for the engine CI actually runs.

(a) /tokenize agrees with the captured fixture (same vocabulary and chat template);
(b) a repeated prompt reports prompt_tokens_details.cached_tokens > 0, another cache_salt 0;
(c) BlockStored events on the PUB socket carry hashing.vllm_hash's engine-exact hashes
    (sha256, seed "vllm-none-hash" since launch.py leaves PYTHONHASHSEED unset);
(d) the replay ROUTER returns the retained batches and the end marker;
(e) kill + restart of one replica: the new engine's KV event seq starts again at 0.
"""
from __future__ import annotations

import random
import time

import httpx
import msgspec
import pytest
import zmq

from hashing.vllm_hash import block_hashes, event_int

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

END_SEQ = b"\xff" * 8
WORDS = "fox while dog brown over lazy routers quick the blocks jumps count a cached".split()


def _text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _unique_seed() -> int:
    return random.SystemRandom().randrange(1 << 30)


def _tokenize(rep, body: dict) -> list[int]:
    r = httpx.post(rep.url + "/tokenize", json={"model": rep.served_model_name, **body}, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def _chat(rep, messages, **extra) -> dict:
    body = {"model": rep.served_model_name, "messages": messages, "max_tokens": 1, "temperature": 0, **extra}
    r = httpx.post(rep.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _completion(rep, prompt: str, **extra) -> dict:
    body = {"model": rep.served_model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    r = httpx.post(rep.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _decode_events(payload: bytes) -> tuple[float, list[dict]]:
    """[ts, [event...], dp_rank]; events as maps (current) or positional arrays (old engines)."""
    batch = msgspec.msgpack.decode(payload)
    out = []
    for ev in batch[1]:
        if isinstance(ev, dict):
            out.append(ev)
        elif ev and ev[0] == "BlockStored":
            out.append({"type": "BlockStored", "block_hashes": ev[1], "parent_block_hash": ev[2], "token_ids": ev[3]})
        elif ev and ev[0] == "BlockRemoved":
            out.append({"type": "BlockRemoved", "block_hashes": ev[1]})
        else:
            out.append({"type": ev[0]})
    return batch[0], out


class Sub:
    """A raw SUB socket on one replica's KV-event endpoint."""

    def __init__(self, ctx: zmq.Context, rep) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, rep.kv_topic)
        self.sock.connect(rep.kv_events_endpoint)
        time.sleep(0.5)  # PUB drops messages until the subscription has propagated

    def recv_until(self, done, timeout: float = 30.0) -> list[tuple[int, list[dict]]]:
        """(seq, events) batches until done(batches) is true; fails on timeout."""
        got: list[tuple[int, list[dict]]] = []
        deadline = time.monotonic() + timeout
        while not done(got):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for KV events; got {got!r}"
            if self.sock.poll(int(left * 1000)):
                topic, seq, payload = self.sock.recv_multipart()
                assert topic == b"kv-events"
                got.append((int.from_bytes(seq, "big"), _decode_events(payload)[1]))
        return got

    def close(self) -> None:
        self.sock.close()


def _stored_hashes(batches) -> list[int]:
    return [h for _, evs in batches for e in evs if e["type"] == "BlockStored" for h in e["block_hashes"]]


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


# -- (a) tokenization parity with the captured fixture -----------------------------------------
def test_tokenize_matches_captured_fixture(vllm_replicas, vllm_fixture):
    rep = vllm_replicas[0]
    checked = 0
    for entry in vllm_fixture["requests"]:
        req = entry.get("request")
        if not req or "tokenize" not in entry:
            continue
        body = {"messages": req["messages"]} if "messages" in req else {"prompt": req["prompt"]}
        assert _tokenize(rep, body) == entry["tokenize"], f"token ids differ for fixture request {checked}"
        checked += 1
    assert checked >= 5
    # And the chat begins with ChatML's <|im_start|>system\n as the captured fixture shows.
    toks = _tokenize(rep, {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})
    assert toks[:3] == [151644, 8948, 198]


# -- (b) engine-reported cached tokens and cache_salt isolation ---------------------------------
def test_cached_tokens_and_salt(vllm_replicas):
    rep = vllm_replicas[1]
    messages = [
        {"role": "system", "content": _text(1200, _unique_seed())},
        {"role": "user", "content": "what is cached?"},
    ]
    n = len(_tokenize(rep, {"messages": messages}))
    assert n > 1000
    first = _chat(rep, messages)["usage"]
    assert first["prompt_tokens"] == n
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    second = _chat(rep, messages)["usage"]
    # Whole blocks only, and the last prompt token is always recomputed.
    assert second["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 32 * 32 > 0
    salted = _chat(rep, messages, cache_salt="tenant-smoke")["usage"]
    assert salted["prompt_tokens_details"]["cached_tokens"] == 0
    salted2 = _chat(rep, messages, cache_salt="tenant-smoke")["usage"]
    assert salted2["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 32 * 32


# -- (c) live KV events carry engine-exact hashes -----------------------------------------------
def test_block_stored_hashes_match_vllm_hash(vllm_replicas, zctx):
    rep = vllm_replicas[0]
    sub = Sub(zctx, rep)
    try:
        prompt = _text(300, _unique_seed())
        tokens = _tokenize(rep, {"prompt": prompt})
        n_full = len(tokens) // rep.block_size
        assert n_full >= 3
        expected = [event_int(d) for d in block_hashes(tokens, rep.block_size, algo="sha256", seed=rep.hash_seed)]
        _completion(rep, prompt)
        batches = sub.recv_until(lambda got: len(_stored_hashes(got)) >= n_full)
        stored = [e for _, evs in batches for e in evs if e["type"] == "BlockStored"]
        assert _stored_hashes(batches)[:n_full] == expected
        assert stored[0]["parent_block_hash"] is None
        stored_tokens = [t for e in stored for t in e["token_ids"]]
        assert stored_tokens[: n_full * rep.block_size] == tokens[: n_full * rep.block_size]
        seqs = [s for s, _ in batches]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

        # Salted: the first block's hash carries ("cache_salt", salt); the event names the salt.
        _completion(rep, prompt, cache_salt="tenant-a")
        batches = sub.recv_until(lambda got: len(_stored_hashes(got)) >= n_full)
        salted_expected = [
            event_int(d) for d in block_hashes(tokens, rep.block_size, algo="sha256", cache_salt="tenant-a", seed=rep.hash_seed)
        ]
        assert _stored_hashes(batches)[:n_full] == salted_expected
        first = next(e for _, evs in batches for e in evs if e["type"] == "BlockStored")
        assert first.get("extra_keys") and first["extra_keys"][0] == ["tenant-a"]
    finally:
        sub.close()


# -- (d) replay ------------------------------------------------------------------------------
def _replay(ctx: zmq.Context, rep, start_seq: int, timeout: float = 30.0) -> list[tuple[int, bytes]]:
    """(seq, payload) of every retained batch from start_seq, up to the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(rep.replay_endpoint)
    try:
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and dealer.poll(int(left * 1000)), f"no replay end marker; got {len(out)} batches"
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            if len(frames) == 4:  # [b"", topic, seq, payload]; end: [b"", b"", ff*8, b""]
                _, topic, seq, payload = frames
            else:  # older engines: [b"", seq, payload]; end: [b"", ff*8, b""]
                _, seq, payload = frames
                topic = None
            if seq == END_SEQ:
                assert payload == b""
                return out
            assert topic in (None, b"kv-events")
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close()


def test_replay_returns_batches_and_end_marker(vllm_replicas, zctx):
    rep = vllm_replicas[0]
    _completion(rep, _text(100, _unique_seed()))  # make sure something is retained
    time.sleep(0.5)
    batches = _replay(zctx, rep, 0)
    assert batches, "replay returned no batches"
    seqs = [s for s, _ in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # contiguous
    types = {e["type"] for _, p in batches for e in _decode_events(p)[1]}
    assert "BlockStored" in types
    # From a later seq: only the tail.
    tail = _replay(zctx, rep, seqs[-1])
    assert [s for s, _ in tail] == [seqs[-1]]


# -- (e) kill and restart: seq resets ---------------------------------------------------------
def test_kill_restart_resets_seq(vllm_replicas, zctx):
    rep = vllm_replicas[-1]
    _completion(rep, _text(100, _unique_seed()))
    old_pid = rep.pid
    rep.kill()
    assert not rep.is_alive()
    with pytest.raises(httpx.HTTPError):
        httpx.get(rep.url + "/health", timeout=2)
    rep.start()
    assert rep.pid != old_pid and rep.health()
    sub = Sub(zctx, rep)
    try:
        _completion(rep, _text(100, _unique_seed()))
        batches = sub.recv_until(lambda got: len(got) >= 1)
        assert batches[0][0] == 0, f"first seq after restart is {batches[0][0]}, expected 0"
    finally:
        sub.close()
