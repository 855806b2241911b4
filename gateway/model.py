"""The served model as the gateway knows it: name, aliases, context length, block-key chain.

Rule: the name and context length come from config when given, else from the first replica that
answers `/v1/models` (gateway.background), else (context length only) from the tokenizer. Until the
name is known the gateway answers 503 not_ready; the key chain is rooted in the name, so every
gateway and agent of one model agree on keys.
"""
from __future__ import annotations

from hashing.keys import KeyChain

__all__ = ["ModelInfo"]


class ModelInfo:
    def __init__(self, name: str | None, aliases: list[str], block_size: int, max_model_len: int | None) -> None:
        self.aliases = list(aliases)  # other names clients may ask for
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
        self.served = frozenset({name, *self.aliases})
        if self.max_model_len is None and max_model_len:
            self.max_model_len = int(max_model_len)
