"""warmroute block keys (a contract: the gateway and the replica agent must compute the same keys).

Rule: only full blocks get a key. For block i of a request (0-based),

    key_i = xxh3_64( parent_le64 || tokens_le32[block_size] || extras_i )

where parent_le64 is key_{i-1} as 8 little-endian bytes (key_{-1} is the root, below), each token
id is 4 little-endian bytes (ids are < 2**32), and extras_i is a tagged byte string:

    extras_i = [ 0x01 u16le(len) salt_utf8 ]   only when i == 0 and a salt is set
               [ 0x02 u16le(len) lora_utf8 ]   on every block when a LoRA adapter is named

(empty when neither applies). The root is `xxh3_64(b"warmroute/root/v1\\0" || model_utf8)`, so
keys of two models never collide by construction. Keys are unsigned 64-bit ints.

The gateway computes keys from the request's own token ids and its derived salt; the agent from
the `token_ids`, `extra_keys` and `lora_name` of the engine's BlockStored events. Neither needs the
engine's hash algorithm or seed, so the two always agree. Empty or short input yields no keys.
"""
from __future__ import annotations

import struct
import sys
from array import array
from typing import NewType, Sequence

import xxhash

__all__ = ["BlockKey", "EngineHash", "KeyChain", "block_extras", "chain_keys", "root_key", "tokens_to_bytes"]

# warmroute's key of a block (xxh3_64 chain above). Distinct from the engine's hash on purpose.
BlockKey = NewType("BlockKey", int)
# The engine's own block hash as published in KV events (u64 int or raw digest bytes): an opaque id.
EngineHash = NewType("EngineHash", object)

_ROOT_PREFIX = b"warmroute/root/v1\x00"
_TAG_SALT = 0x01
_TAG_LORA = 0x02
_xxh3 = xxhash.xxh3_64_intdigest
_LITTLE = sys.byteorder == "little"


def root_key(model: str) -> BlockKey:
    """key_{-1}: the parent of block 0, derived from the model identity (served model name)."""
    return BlockKey(_xxh3(_ROOT_PREFIX + model.encode("utf-8")))


def _tagged(tag: int, value: str) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise ValueError(f"extra key too long ({len(raw)} bytes); at most 65535")
    return bytes((tag,)) + struct.pack("<H", len(raw)) + raw


def block_extras(salt: str | None = None, lora: str | None = None) -> tuple[bytes, bytes]:
    """Return (extras of block 0, extras of every later block) for a salt and a LoRA name."""
    lora_part = _tagged(_TAG_LORA, lora) if lora else b""
    first = (_tagged(_TAG_SALT, salt) if salt else b"") + lora_part
    return first, lora_part


def tokens_to_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as consecutive u32 little-endian values."""
    arr = array("I", token_ids)
    if arr.itemsize != 4:  # pragma: no cover - exotic platforms
        arr = array("L", token_ids)
    if not _LITTLE:  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def chain_keys(
    parent: int,
    token_ids: Sequence[int],
    block_size: int,
    first_extras: bytes = b"",
    extras: bytes = b"",
) -> list[BlockKey]:
    """Keys of the full blocks of `token_ids`, chained from `parent`.

    `first_extras` applies to the first block of this run, `extras` to the rest: pass
    `block_extras(salt, lora)` for a run that starts at block 0, and `(lora_part, lora_part)` for
    a run that continues a chain. A trailing partial block gets no key.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = len(token_ids) // block_size
    if n_blocks == 0:
        return []
    data = tokens_to_bytes(token_ids[: n_blocks * block_size])
    step = block_size * 4
    out: list[BlockKey] = []
    append = out.append
    p = parent
    tail = first_extras
    for off in range(0, n_blocks * step, step):
        p = _xxh3(p.to_bytes(8, "little") + data[off : off + step] + tail)
        append(p)
        tail = extras
    return out


class KeyChain:
    """Keys for one (model, block size) pair: what the gateway computes per request."""

    __slots__ = ("model", "block_size", "root")

    def __init__(self, model: str, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.model = model
        self.block_size = block_size
        self.root = root_key(model)

    def request_keys(self, token_ids: Sequence[int], salt: str | None = None, lora: str | None = None) -> list[BlockKey]:
        """Keys of every full block of a request's prompt, from block 0."""
        first, rest = block_extras(salt, lora)
        return chain_keys(self.root, token_ids, self.block_size, first, rest)
