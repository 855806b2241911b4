"""The served model as the gateway knows it: name, aliases, LoRA adapters, context length, block-key chain.

Rule: the name and context length come from config when given, else from the first replica that
answers `/v1/models` (gateway.background), else (context length only) from the tokenizer. Until the
name is known the gateway answers 503 not_ready; the key chain is rooted in the name, so every
gateway and agent of one model agree on keys.

LoRA adapters are served names of their own. Configured ones (`model.lora_adapters`: vLLM
`--lora-modules NAME=PATH` on every replica) are taken to be on every replica. Others are what each
replica's `/v1/models` lists with the model as `parent` (adapters loaded at start or at run time,
`/v1/load_lora_adapter`), as last heard (gateway.background asks every `model.lora_discovery_s`);
a request for one may go only to the replicas that listed it (`replicas_for`), and one no replica
lists any more is no longer served (404); a name not served is looked up again before it is
refused, and a replica that answers 404 for an adapter it listed loses it from its listing
(`unlist`; both in gateway.adapters). A request for an adapter goes upstream under the
adapter's name, and its block keys carry the adapter's name on every block (hashing.keys), as the
engine's hashes and the agent's keys (from the events' `lora_name`) do: an adapter's blocks are
never the base model's, nor another adapter's.
"""
from __future__ import annotations

from typing import Iterable

from hashing.keys import KeyChain

__all__ = ["ModelInfo"]


class ModelInfo:
    def __init__(self, name: str | None, aliases: list[str], block_size: int, max_model_len: int | None,
                 lora_adapters: Iterable[str] = ()) -> None:
        self.aliases = list(aliases)  # other names clients may ask for
        self.configured_adapters: frozenset[str] = frozenset(lora_adapters)  # on every replica (module header)
        self.listed: dict[str, frozenset[str]] = {}  # replica -> the adapters its /v1/models listed last
        self.adapters: frozenset[str] = self.configured_adapters  # every adapter served, by any replica
        self.block_size = block_size  # the engines' KV block size (tokens)
        self.name: str | None = None  # the canonical served name (None: not known yet)
        self.served: frozenset[str] = frozenset()  # names answered for
        self.max_model_len = max_model_len  # context length in tokens (None: not known yet)
        self.keychain: KeyChain | None = None  # block keys for this model (None until the name is known)
        if name is not None:
            self.set(name, None)

    @property
    def known(self) -> bool:
        return self.name is not None

    def set(self, name: str, max_model_len: int | None) -> None:
        """Adopt `name` (and `max_model_len` unless one is already set)."""
        self.name = name
        self.keychain = KeyChain(name, self.block_size)
        self._served()
        if self.max_model_len is None and max_model_len:
            self.max_model_len = int(max_model_len)

    def set_listed(self, replica_id: str, names: Iterable) -> None:
        """The adapters `replica_id`'s /v1/models lists now (discovery)."""
        own = {self.name, *self.aliases}
        self.listed[replica_id] = frozenset(n for n in names if isinstance(n, str) and n and n not in own)
        self._served()

    def unlist(self, replica_id: str, adapter: str) -> bool:
        """`replica_id` answered 404 for `adapter`, which it listed: it unloaded it (until a
        discovery round lists it there again). Whether it was listed there."""
        names = self.listed.get(replica_id, frozenset())
        if adapter not in names:
            return False
        self.listed[replica_id] = names - {adapter}
        self._served()
        return True

    def forget_replica(self, replica_id: str) -> None:
        """The replica left the pool: its adapters are served no more unless another lists them."""
        if self.listed.pop(replica_id, None) is not None:
            self._served()

    def _served(self) -> None:
        self.adapters = self.configured_adapters.union(*self.listed.values())
        if self.name is not None:
            self.served = frozenset({self.name, *self.aliases, *self.adapters})

    def lora_of(self, model: str) -> str | None:
        """The LoRA adapter a request for `model` runs (None: the base model)."""
        return model if model in self.adapters else None

    def replicas_for(self, lora: str | None) -> frozenset[str] | None:
        """The replicas a request running `lora` may go to; None: any (the base model, or a
        configured adapter, which every replica serves)."""
        if lora is None or lora in self.configured_adapters:
            return None
        return frozenset(rid for rid, names in self.listed.items() if lora in names)
