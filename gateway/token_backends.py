"""The tokenizer's fast-path building blocks (pure, no I/O beyond reading the tokenizer directory):
the per-segment id cache, the check that a tokenizer may be encoded piece by piece between its
added tokens, and the tiktoken encoding over the same BPE ranks (gateway.tokenization's module
docstring says why each is exact).
"""
from __future__ import annotations

import base64
import json
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import tiktoken

__all__ = ["SegmentCache", "segment_safe", "load_tiktoken", "SAFE_PRETOKENIZERS", "SAFE_NORMALIZERS"]

# Pre-tokenizers / normalizers whose result on a piece does not depend on where the piece sits.
SAFE_PRETOKENIZERS = frozenset({"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit", "Sequence"})
SAFE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Sequence", "Strip", "Replace", "Prepend"})


class SegmentCache:
    """Thread-safe LRU of token ids per text segment, bounded by entries and approximate bytes."""

    def __init__(self, max_entries: int = 8192, max_bytes: int = 256 * 2**20) -> None:
        self.max_entries = max(0, int(max_entries))
        self.max_bytes = max(0, int(max_bytes))
        self._d: OrderedDict[str, tuple[list[int], int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    @staticmethod
    def entry_size(text: str, ids: list[int]) -> int:
        # str object + list of pointers + int objects (ids above 256 are not interned).
        return sys.getsizeof(text) + 64 + 36 * len(ids)

    def __len__(self) -> int:
        return len(self._d)

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def get(self, text: str) -> list[int] | None:
        with self._lock:
            item = self._d.get(text)
            if item is None:
                self.misses += 1
                return None
            self._d.move_to_end(text)
            self.hits += 1
            return item[0]

    def holds(self, text: str) -> bool:
        """Is `text` cached? A peek: no hit/miss counted, LRU order unchanged."""
        with self._lock:
            return text in self._d

    def put(self, text: str, ids: list[int]) -> None:
        size = self.entry_size(text, ids)
        if size > self.max_bytes or not self.enabled:
            return
        with self._lock:
            old = self._d.pop(text, None)
            if old is not None:
                self.bytes -= old[1]
            self._d[text] = (ids, size)
            self.bytes += size
            while len(self._d) > self.max_entries or self.bytes > self.max_bytes:
                _, (_, sz) = self._d.popitem(last=False)
                self.bytes -= sz

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self.bytes = 0


def segment_safe(tokenizer_json: dict) -> tuple[bool, str]:
    """Can ids be computed per piece between added tokens? (see module docstring, point 1)"""
    for t in tokenizer_json.get("added_tokens", []):
        if t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
            return False, f"added token {t.get('content')!r} has strip/single_word flags"
        if t.get("normalized") and tokenizer_json.get("normalizer") is not None:
            return False, f"added token {t.get('content')!r} is matched after normalisation"

    def types(node: Any, key: str) -> list[str]:
        if node is None:
            return []
        out = [node.get("type", "?")]
        for child in node.get(key, []) or []:
            out += types(child, key)
        return out

    for typ in types(tokenizer_json.get("pre_tokenizer"), "pretokenizers"):
        if typ not in SAFE_PRETOKENIZERS:
            return False, f"pre-tokenizer {typ} may depend on the piece's position"
    for typ in types(tokenizer_json.get("normalizer"), "normalizers"):
        if typ not in SAFE_NORMALIZERS:
            return False, f"normalizer {typ} may depend on the piece's position"
    if tokenizer_json.get("model", {}).get("type") not in ("BPE", "WordPiece", "Unigram", "WordLevel"):
        return False, "unknown model type"
    return True, ""


def load_tiktoken(tokenizer_dir: Path):
    cfg_path = tokenizer_dir / "warmroute_tokenizer.json"
    if not cfg_path.exists():
        return None, "no warmroute_tokenizer.json"
    cfg = json.loads(cfg_path.read_text())["tiktoken"]
    ranks: dict[bytes, int] = {}
    with open(tokenizer_dir / cfg["ranks_file"], "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    enc = tiktoken.Encoding(
        f"warmroute:{tokenizer_dir.name}", pat_str=cfg["pat_str"], mergeable_ranks=ranks,
        special_tokens={k: int(v) for k, v in cfg["special_tokens"].items()},
    )
    return enc, ""
