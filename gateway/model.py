"""The served model as the gateway knows it: name, aliases, LoRA adapters, context length, block-key chain.

Rule: the name and context length come from config when given, else from the first replica that
answers `/v1/models` (gateway.background), else (context length only) from the tokenizer. Until the
name is known the gateway answers 503 not_ready; the key chain is rooted in the name, so every
gateway and agent of one model agree on keys.

LoRA adapters (vLLM `--lora-modules NAME=PATH` on every replica) are served names of their own:
config's `model.lora_adapters`, plus those `/v1/models` lists with the model as `parent` when the
gateway discovers its model. A request for an adapter goes upstream under the adapter's name, and
its block keys carry the adapter's name on every block (hashing.keys), as the engine's hashes and
the agent's keys (from the events' `lora_name`) do: an adapter's blocks are never the base
model's, nor another adapter's.
"""
from __future__ import annotations

from typing import Iterable

from hashing.keys import KeyChain

__all__ = ["ModelInfo"]


class ModelInfo:
    def __init__(self, name: str | None, aliases: list[str], block_size: int, max_model_len: int | None,
                 lora_adapters: Iterable[str] = ()) -> None:
        self.aliases = list(aliases)  # other names clients may ask for
        self.adapters: frozenset[str] = frozenset(lora_adapters)  # LoRA adapters' names (module header)
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
        self.served = frozenset({name, *self.aliases, *self.adapters})
        if self.max_model_len is None and max_model_len:
            self.max_model_len = int(max_model_len)

    def add_adapters(self, names: Iterable) -> None:
        """LoRA adapters the replicas serve, besides those already known (discovery)."""
        new = frozenset(n for n in names if isinstance(n, str) and n and n != self.name and n not in self.aliases)
        if new - self.adapters:
            self.adapters |= new
            if self.name is not None:
                self.served = frozenset({self.name, *self.aliases, *self.adapters})

    def lora_of(self, model: str) -> str | None:
        """The LoRA adapter a request for `model` runs (None: the base model)."""
        return model if model in self.adapters else None
