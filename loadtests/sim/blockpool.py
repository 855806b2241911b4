"""Paged KV block pool with prefix caching, as vLLM's v1 BlockPool keeps it. Pure: no I/O, no asyncio.

Rules (vLLM v1, `vllm/v1/core/block_pool.py`):
- Capacity is a fixed number of blocks of `block_size` tokens. A block is *used* while its
  reference count is > 0, *free* otherwise. Free blocks sit in one queue in eviction order
  (least recently freed first); allocation takes from the head.
- A block that became full gets the request's engine-exact block hash (hashing.vllm_hash) and is
  entered in the cache map. Freeing keeps it cached: a later request with the same chained hash
  takes it back (a hit) and removes it from the free queue. Only when an allocation takes a free
  cached block for new data is the block *evicted*: its hash leaves the map and a BlockRemoved
  event is recorded.
- The map is hash -> {block_id: block}: like vLLM the pool does not de-duplicate, two requests
  computing the same block concurrently each store it (two BlockStored, later two BlockRemoved).
- Events are appended to a list the owner drains with `take_events()`; the pool never publishes.
  Event hashes are raw digests (bytes); the publisher turns them into u64 ints.

Capacity from a model shape: kv_bytes_per_token = 2 (K and V) x layers x KV heads x head dim x
bytes per element. Defaults: Llama-3-8B (32 layers, 8 KV heads, head dim 128, fp16) = 128 KiB per
token; a 40 GiB KV budget (an 80 GB A100/H100 at gpu_memory_utilization 0.9 minus 16 GB of weights
and activation headroom) holds 327,680 tokens = 20,480 blocks of 16.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "KVBlock",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "PoolEvent",
    "BlockPool",
    "ModelShape",
    "LLAMA3_8B",
    "DEFAULT_KV_BUDGET_BYTES",
    "num_blocks_for_budget",
]


@dataclass(slots=True)
class KVBlock:
    block_id: int  # index in the pool, 0..num_blocks-1
    ref_cnt: int = 0  # requests currently holding the block
    block_hash: bytes | None = None  # engine digest once full and cached, else None


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[bytes]  # digests of the newly stored full blocks, in chain order
    parent_block_hash: bytes | None  # digest of the block before the run; None when it starts at block 0
    token_ids: list[int]  # all tokens of those blocks, concatenated
    block_size: int  # tokens per block
    extra_keys: list[list | None]  # one entry per block: None, or the untagged extras ([salt] on block 0)
    lora_name: str | None = None  # LoRA adapter name (a request for an adapter: on every block's extras too)
    medium: str = "GPU"  # where the blocks live


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[bytes]  # digests of evicted blocks
    medium: str = "GPU"  # where they lived


@dataclass(slots=True)
class AllBlocksCleared:
    pass


PoolEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int  # transformer layers
    num_kv_heads: int  # KV heads (GQA)
    head_dim: int  # per-head dimension
    dtype_bytes: int = 2  # bytes per KV element (fp16/bf16)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


LLAMA3_8B = ModelShape(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
DEFAULT_KV_BUDGET_BYTES = 40 * 1024**3


def num_blocks_for_budget(block_size: int, kv_budget_bytes: int = DEFAULT_KV_BUDGET_BYTES, shape: ModelShape = LLAMA3_8B) -> int:
    """Blocks of `block_size` tokens that fit in `kv_budget_bytes` for a model of `shape`."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n = kv_budget_bytes // (shape.kv_bytes_per_token * block_size)
    if n <= 0:
        raise ValueError(f"KV budget {kv_budget_bytes} bytes holds no block of {block_size} tokens; raise it")
    return int(n)


class BlockPool:
    """`num_blocks` KV blocks with prefix caching and LRU eviction of free cached blocks."""

    __slots__ = ("num_blocks", "block_size", "blocks", "_free", "_cached", "_events", "enable_caching", "num_evicted_blocks")

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # NOTE: an OrderedDict gives O(1) pop-from-head, append and remove-from-middle (a hit on a
        # free cached block), which is all vLLM's hand-written doubly linked list provides.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, dict[int, KVBlock]] = {}
        self._events: list[PoolEvent] = []
        self.num_evicted_blocks = 0  # lifetime count, for metrics

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (vllm:kv_cache_usage_perc, 0..1)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(d) for d in self._cached.values())

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        d = self._cached.get(block_hash)
        if not d:
            return None
        return next(iter(d.values()))

    def find_prefix(self, block_hashes: Sequence[bytes], max_blocks: int) -> list[KVBlock]:
        """The cached blocks of the longest leading run of `block_hashes` (at most `max_blocks`).
        Does not take references: call `touch` on the result to keep them."""
        out: list[KVBlock] = []
        if not self.enable_caching:
            return out
        cached = self._cached
        for h in block_hashes[:max_blocks]:
            d = cached.get(h)
            if not d:
                break
            out.append(next(iter(d.values())))
        return out

    # -- mutations -----------------------------------------------------------------------------
    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on each block (a prefix-cache hit); free ones leave the free queue."""
        free = self._free
        for b in blocks:
            if b.ref_cnt == 0:
                del free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock] | None:
        """Take `n` blocks from the head of the free queue (evicting cached ones), ref 1 each.
        Returns None, changing nothing, when fewer than `n` are free."""
        if n > len(self._free):
            return None
        free = self._free
        out = []
        removed: list[bytes] = []
        for _ in range(n):
            _, b = free.popitem(last=False)
            h = b.block_hash
            if h is not None:
                d = self._cached.get(h)
                if d is not None:
                    d.pop(b.block_id, None)
                    if not d:
                        del self._cached[h]
                b.block_hash = None
                removed.append(h)
            b.ref_cnt = 1
            out.append(b)
        if removed:
            self.num_evicted_blocks += len(removed)
            # vLLM emits one BlockRemoved per evicted block (seen in the captured fixture).
            self._events.extend(BlockRemoved([h]) for h in removed)
        return out

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop a reference from each block; blocks reaching 0 join the tail of the free queue in
        the order given (callers pass a request's blocks reversed, so its tail is evicted first)."""
        free = self._free
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                free[b.block_id] = b
            elif b.ref_cnt < 0:  # pragma: no cover - a caller bug
                raise RuntimeError(f"block {b.block_id} freed more often than taken")

    def cache_full_blocks(
        self,
        blocks: Sequence[KVBlock],
        block_hashes: Sequence[bytes],
        start_idx: int,
        end_idx: int,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        emit: bool = True,
        lora: str | None = None,
    ) -> None:
        """Mark the request's blocks [start_idx, end_idx) as full and cached under their hashes and
        record one BlockStored for the run. `token_ids` are the request's tokens (at least
        end_idx x block_size of them)."""
        if end_idx <= start_idx or not self.enable_caching:
            return
        cached = self._cached
        for i in range(start_idx, end_idx):
            b = blocks[i]
            h = block_hashes[i]
            if b.block_hash is not None:  # already cached (a hit block): nothing to store
                continue
            b.block_hash = h
            d = cached.get(h)
            if d is None:
                cached[h] = {b.block_id: b}
            else:
                d[b.block_id] = b
        if emit:
            self._events.append(self.stored_event(block_hashes, start_idx, end_idx, token_ids, cache_salt, lora))

    def stored_event(
        self, block_hashes: Sequence[bytes], start_idx: int, end_idx: int, token_ids: Sequence[int], cache_salt: str | None,
        lora: str | None = None,
    ) -> BlockStored:
        bs = self.block_size
        extra: list[list | None] = [[lora] if lora else None for _ in range(end_idx - start_idx)]
        if cache_salt and start_idx == 0:
            extra[0] = [lora, cache_salt] if lora else [cache_salt]
        return BlockStored(
            block_hashes=list(block_hashes[start_idx:end_idx]),
            parent_block_hash=block_hashes[start_idx - 1] if start_idx > 0 else None,
            token_ids=list(token_ids[start_idx * bs : end_idx * bs]),
            block_size=bs,
            extra_keys=extra,
            lora_name=lora,
        )

    def record(self, event: PoolEvent) -> None:
        """Append an event the owner decided on (e.g. re-reporting hits in report mode "full")."""
        self._events.append(event)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (used blocks keep their data but can no longer be hit) and
        record AllBlocksCleared."""
        for b in self.blocks:
            b.block_hash = None
        self._cached.clear()
        self._events.append(AllBlocksCleared())

    def take_events(self) -> list[PoolEvent]:
        ev = self._events
        self._events = []
        return ev
