"""The gateway's own keys for a chat's blocks past its first media item (pure; no engine event names them).

vLLM keys a block that holds a media item's placeholders with the item's hash, which the gateway
cannot compute (the model's processor decides the placeholders), and every later block chains from
it; so past its first item a chat has no key the index can learn from the engines' events, and a
conversation about an image would be routed by its text before the image alone: every turn to
whichever replica holds the system prompt, its image and history prefilled again. What the gateway
does know is where it sent each turn. These keys stand for those blocks:

    k_0 = xxh3_64( TAG || parent_le64 || tail_tokens_le32 || extras_0 )
    D_u = xxh3_64( D_{u-1}_le64 || digest_u_le64 ),  D_{-1} = 0
    k_j = xxh3_64( k_{j-1}_le64 || D_u_le64 )  for each estimated block whose end falls in unit u

where `parent` is the request's last full-block key (hashing.keys; the model's root when it has
none), `tail_tokens` the ids of its partial block before the item, `extras_0` hashing.keys' salt
and adapter extras, and the units what follows the item, each as (a digest, estimated tokens)
(gateway.chat_messages.history_units: its items, its text, each later message). D_u runs over
every unit so far, so a unit too short to end a block still tells the keys after it apart. A
conversation's next turn repeats its messages, so its keys begin with the last turn's run, which
the replica that served it holds as speculative entries (gateway.routing.linger), and a popular
image after the same text keys alike in every conversation; a different image or text diverges
from there. The TAG keeps them apart from every engine-derived key, and the salt between tenants.
"""
from __future__ import annotations

from typing import Sequence

import xxhash

from hashing.keys import BlockKey, block_extras, tokens_to_bytes

__all__ = ["history_keys"]

_TAG = b"warmroute/media-history/v1\x00"
_xxh3 = xxhash.xxh3_64_intdigest


def history_keys(parent: int, tail_ids: Sequence[int], units: Sequence[tuple[int, int]], block_size: int, *,
                 salt: str | None = None, lora: str | None = None) -> list[BlockKey]:
    """Keys of the estimated blocks past a chat's first media item (module rule)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    p = _xxh3(_TAG + parent.to_bytes(8, "little") + tokens_to_bytes(tail_ids) + block_extras(salt, lora)[0])
    out: list[BlockKey] = []
    done = len(tail_ids)  # tokens of the first block already before the item
    acc = 0
    for digest, tokens in units:
        end = done + max(0, tokens)
        acc = _xxh3(acc.to_bytes(8, "little") + digest.to_bytes(8, "little"))
        d = acc.to_bytes(8, "little")
        for _ in range(done // block_size, end // block_size):
            p = _xxh3(p.to_bytes(8, "little") + d)
            out.append(BlockKey(p))
        done = end
    return out
