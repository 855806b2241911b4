"""vLLM's engine-exact prefix-cache block hashes (v1 engine), for the simulator and for checks.

    block_hash = H(serialize((parent_hash_bytes, tuple(block_token_ids), extra_keys_or_None)))

chained over full blocks; block 0's parent is NONE_HASH = H(serialize(seed)), seed being
$PYTHONHASHSEED if set, else "vllm-none-hash". `serialize` is pickle protocol 5 for `sha256` and
canonical CBOR for `sha256_cbor`. Extra keys as hashed are tagged tuples: `("cache_salt", salt)` on
block 0 only, `("lora", name, path)`... (only the salt is modelled here). KV events carry the last
8 bytes of the digest as an unsigned big-endian int (`event_int`). Verified against vLLM's own
hashes (seed "vllm-none-hash", tokens 0..15) and the captured real-vLLM fixture (tests/test_hashing.py).
"""
from __future__ import annotations

import hashlib
import os
import pickle
from typing import Callable, Sequence

__all__ = ["HASH_ALGOS", "default_seed", "none_hash", "hash_block", "block_hashes", "event_int"]


def _ser_pickle(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=5)


def _ser_cbor(obj: object) -> bytes:
    import cbor2

    return cbor2.dumps(obj, canonical=True)


HASH_ALGOS: dict[str, Callable[[object], bytes]] = {"sha256": _ser_pickle, "sha256_cbor": _ser_cbor}


def default_seed() -> str:
    return os.environ.get("PYTHONHASHSEED") or "vllm-none-hash"


def _serializer(algo: str) -> Callable[[object], bytes]:
    try:
        return HASH_ALGOS[algo]
    except KeyError:
        raise ValueError(f"unknown prefix-caching hash algo {algo!r}; choose one of {sorted(HASH_ALGOS)}") from None


def none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    return hashlib.sha256(_serializer(algo)(seed if seed is not None else default_seed())).digest()


def hash_block(algo: str, parent: bytes, token_ids: Sequence[int], extra_keys: tuple | None) -> bytes:
    return hashlib.sha256(_serializer(algo)((parent, tuple(token_ids), extra_keys))).digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    algo: str = "sha256",
    cache_salt: str | None = None,
    seed: str | None = None,
    parent: bytes | None = None,
    start_block: int = 0,
    lora: str | None = None,
) -> list[bytes]:
    """Digests of the full blocks of `token_ids` (block `start_block` onwards of the request,
    chained from `parent`, NONE_HASH by default). `lora`: the adapter's `("lora", name, path)`
    extra on every block, its name standing in for the path (which only the engine knows)."""
    ser = _serializer(algo)
    p = parent if parent is not None else none_hash(algo, seed)
    out = []
    n = len(token_ids) // block_size
    lora_extra = (("lora", lora, lora),) if lora else ()
    for i in range(n):
        extra = lora_extra + ((("cache_salt", cache_salt),) if (cache_salt and start_block + i == 0) else ())
        extra = extra or None
        p = hashlib.sha256(ser((p, tuple(token_ids[i * block_size : (i + 1) * block_size]), extra))).digest()
        out.append(p)
    return out


def event_int(digest: bytes) -> int:
    """The u64 int form vLLM publishes in KV events (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)."""
    return int.from_bytes(digest[-8:], "big")
