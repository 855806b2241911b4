"""Engine hashes -> warmroute block keys, with reference counts (pure; the key layout is hashing/keys.py's).

Rule: for each BlockStored run, keys are recomputed from its `token_ids` with hashing/keys.py:
  - parent nil: chain from `root_key(model)`; block 0's extras carry the salt, which the engine
    reports as the bare string in `extra_keys[0]` (e.g. `["tenant-a"]`);
  - parent set: chain from the key already mapped to the parent's engine hash (any medium); if the
    parent is unknown (missed events, joined late) the whole run is dropped and counted in
    `stats.unknown_parent_runs` / `unknown_parent_blocks`: a key is never guessed;
  - every block carries `lora_name` as its LoRA extra. Extra-key items we cannot represent (e.g.
    multimodal hashes) are folded into that block's extras under a private tag, so such keys chain
    consistently but never equal a key the gateway computes from text alone (no false matches).
The engine hash is kept only as an opaque id, for later removals and as a parent.

Reference counts, per medium and engine hash: the engine does not de-duplicate, so a second
BlockStored of a held hash adds a reference and a BlockRemoved drops one; the key leaves the
replica's set when the count of every engine hash mapped to it reaches 0.
NOTE (seen in the captured vLLM 0.32 fixture): hits re-reported under `kv_cache_report_mode=
"full"` arrive as a second BlockStored of a held hash and are later removed only once. Counting
them would leave such keys stale forever. A medium can never hold more blocks than the engine has
(`capacity_blocks`, from `vllm:cache_config_info{num_gpu_blocks}`), so whenever the references on
a medium exceed that capacity, the surplus references (counts above 1) are collapsed to 1: they
cannot all be physical copies. With no capacity known, counts are kept as reported.

Output: `Translator.apply(event) -> list[Record]` with `KeysStored(medium, keys)` (keys that
*entered* the set), `KeysRemoved(medium, keys)` (keys that *left* it) and `Cleared()`; the agent
publishes them. Empty input gives no records.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Union

from hashing.keys import BlockKey, EngineHash, block_extras, chain_keys, root_key

from .decode import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["Cleared", "KeysRemoved", "KeysStored", "Record", "TranslateStats", "Translator"]

_TAG_UNKNOWN = 0x7F  # private extras tag for extra-key items warmroute keys do not model


@dataclass(frozen=True, slots=True)
class KeysStored:
    medium: str  # tier
    keys: tuple[int, ...]  # keys that entered the replica's set on that tier, chain order


@dataclass(frozen=True, slots=True)
class KeysRemoved:
    medium: str  # tier
    keys: tuple[int, ...]  # keys that left the replica's set on that tier


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Record = Union[KeysStored, KeysRemoved, Cleared]


@dataclass(slots=True)
class TranslateStats:
    stored_blocks: int = 0  # blocks of BlockStored events seen
    removed_blocks: int = 0  # hashes of BlockRemoved events seen
    duplicate_stores: int = 0  # stores of an already-held engine hash (reference added)
    collapsed_refs: int = 0  # surplus references dropped by the capacity rule
    unknown_parent_runs: int = 0  # BlockStored runs dropped: parent hash unknown
    unknown_parent_blocks: int = 0  # blocks in those runs
    unknown_removals: int = 0  # BlockRemoved of a hash never stored (or already gone)
    malformed_runs: int = 0  # token_ids not matching block_hashes x block_size
    clears: int = 0  # AllBlocksCleared seen


@dataclass(slots=True)
class _Tier:
    key_of: dict = field(default_factory=dict)  # engine hash -> key (held with >= 1 reference)
    extra_refs: dict = field(default_factory=dict)  # engine hash -> references beyond the first
    key_refs: dict = field(default_factory=dict)  # key -> number of held engine hashes mapping to it
    refs_total: int = 0  # sum of references on this tier


class Translator:
    """One replica's engine-hash -> key mapping and key sets (see the module rule)."""

    def __init__(self, model: str, block_size: int = 0, capacity_blocks: dict[str, int] | None = None) -> None:
        self.model = model
        self.block_size = block_size  # fallback when an event does not carry one
        self.capacity_blocks: dict[str, int] = dict(capacity_blocks or {})  # medium -> blocks
        self.root = root_key(model)
        self.stats = TranslateStats()
        self._tiers: dict[str, _Tier] = {}
        self._salt_cache: dict[Any, tuple[bytes, bytes]] = {}

    # -------------------------------------------------------------- views
    def keys(self, medium: str = "GPU") -> tuple[int, ...]:
        """The replica's current key set on one tier."""
        tier = self._tiers.get(medium)
        return tuple(tier.key_refs) if tier else ()

    def keys_by_medium(self) -> dict[str, tuple[int, ...]]:
        return {m: tuple(t.key_refs) for m, t in self._tiers.items() if t.key_refs}

    def key_of(self, engine_hash: EngineHash) -> BlockKey | None:
        for tier in self._tiers.values():
            k = tier.key_of.get(engine_hash)
            if k is not None:
                return k
        return None

    def refcount(self, engine_hash: EngineHash, medium: str = "GPU") -> int:
        tier = self._tiers.get(medium)
        if tier is None or engine_hash not in tier.key_of:
            return 0
        return 1 + tier.extra_refs.get(engine_hash, 0)

    def reset(self) -> None:
        """Forget everything (resync): the caller publishes a Cleared."""
        self._tiers.clear()

    # -------------------------------------------------------------- events
    def apply_all(self, events: Iterable[KVEvent]) -> list[Record]:
        out: list[Record] = []
        for ev in events:
            out.extend(self.apply(ev))
        return out

    def apply(self, event: KVEvent) -> list[Record]:
        if type(event) is BlockStored:
            return self._stored(event)
        if type(event) is BlockRemoved:
            return self._removed(event)
        if type(event) is AllBlocksCleared:
            self.stats.clears += 1
            self._tiers.clear()
            return [Cleared()]
        return []

    def _tier(self, medium: str) -> _Tier:
        t = self._tiers.get(medium)
        if t is None:
            t = self._tiers[medium] = _Tier()
        return t

    def _stored(self, ev: BlockStored) -> list[Record]:
        hashes = ev.block_hashes
        n = len(hashes)
        st = self.stats
        st.stored_blocks += n
        if not n:
            return []
        bs = ev.block_size or self.block_size
        if bs <= 0 or len(ev.token_ids) < n * bs:
            st.malformed_runs += 1
            return []
        if ev.parent_block_hash is None:
            parent = self.root
            at_root = True
        else:
            parent = self.key_of(ev.parent_block_hash)
            if parent is None:
                st.unknown_parent_runs += 1
                st.unknown_parent_blocks += n
                return []
            at_root = False
        lora = ev.lora_name
        ek = ev.extra_keys
        if ek is None or all(x is None for x in ek):
            first, rest = self._extras(at_root, None, lora)
            keys = chain_keys(parent, ev.token_ids[: n * bs], bs, first, rest)
        else:
            keys = self._chain_with_extras(parent, ev.token_ids, bs, n, at_root, ek, lora)
        tier = self._tier(ev.medium)
        key_of = tier.key_of
        key_refs = tier.key_refs
        entered: list[int] = []
        left: list[int] = []
        for h, k in zip(hashes, keys):
            old = key_of.get(h)
            if old is None:
                key_of[h] = k
                c = key_refs.get(k, 0)
                key_refs[k] = c + 1
                if not c:
                    entered.append(k)
            elif old == k:
                tier.extra_refs[h] = tier.extra_refs.get(h, 0) + 1
                st.duplicate_stores += 1
            else:
                # the same engine hash now names another key (extras we cannot see changed): the
                # newest mapping wins; the old key loses every reference this hash held
                key_of[h] = k
                tier.refs_total -= tier.extra_refs.pop(h, 0) + 1
                if self._unref_key(tier, old):
                    left.append(old)
                c = key_refs.get(k, 0)
                key_refs[k] = c + 1
                if not c:
                    entered.append(k)
            tier.refs_total += 1
        out: list[Record] = [KeysRemoved(ev.medium, tuple(left))] if left else []
        return out + self._finish_store(tier, ev.medium, entered)

    def _finish_store(self, tier: _Tier, medium: str, entered: list[int]) -> list[Record]:
        cap = self.capacity_blocks.get(medium, 0)
        if cap and tier.refs_total > cap and tier.extra_refs:
            surplus = sum(tier.extra_refs.values())
            self.stats.collapsed_refs += surplus
            tier.refs_total -= surplus
            tier.extra_refs.clear()
        return [KeysStored(medium, tuple(entered))] if entered else []

    @staticmethod
    def _unref_key(tier: _Tier, key: int) -> bool:
        c = tier.key_refs.get(key, 0)
        if c <= 1:
            tier.key_refs.pop(key, None)
            return True
        tier.key_refs[key] = c - 1
        return False

    def _removed(self, ev: BlockRemoved) -> list[Record]:
        st = self.stats
        st.removed_blocks += len(ev.block_hashes)
        tier = self._tiers.get(ev.medium)
        if tier is None:
            st.unknown_removals += len(ev.block_hashes)
            return []
        left: list[int] = []
        key_of = tier.key_of
        extra = tier.extra_refs
        for h in ev.block_hashes:
            k = key_of.get(h)
            if k is None:
                st.unknown_removals += 1
                continue
            tier.refs_total -= 1
            e = extra.get(h)
            if e:
                if e == 1:
                    del extra[h]
                else:
                    extra[h] = e - 1
                continue
            del key_of[h]
            if self._unref_key(tier, k):
                left.append(k)
        return [KeysRemoved(ev.medium, tuple(left))] if left else []

    # -------------------------------------------------------------- extras
    def _extras(self, at_root: bool, salt: str | None, lora: str | None) -> tuple[bytes, bytes]:
        ck = (at_root, salt, lora)
        v = self._salt_cache.get(ck)
        if v is None:
            first, rest = block_extras(salt, lora)
            v = (first if at_root else rest, rest)
            if len(self._salt_cache) > 4096:
                self._salt_cache.clear()
            self._salt_cache[ck] = v
        return v

    def _chain_with_extras(self, parent: int, token_ids, bs: int, n: int, at_root: bool, ek, lora) -> list[int]:
        """Block by block when extra_keys carry something (salt on block 0, or unmodelled items)."""
        keys: list[int] = []
        _, lora_part = self._extras(False, None, lora)
        for i in range(n):
            items = ek[i] if i < len(ek) else None
            salt = None
            unknown = b""
            if items:
                for item in items:
                    if lora and item == lora:
                        continue  # the LoRA name is already an extra of every block
                    if i == 0 and at_root and salt is None and isinstance(item, str):
                        salt = item
                        continue
                    raw = repr(item).encode("utf-8")[:0xFFFF]
                    unknown += bytes((_TAG_UNKNOWN,)) + struct.pack("<H", len(raw)) + raw
            if i == 0 and at_root:
                extras = block_extras(salt, lora)[0]
            else:
                extras = lora_part
            k = chain_keys(parent, token_ids[i * bs : (i + 1) * bs], bs, extras + unknown)[0]
            keys.append(k)
            parent = k
        return keys
