"""The gateway's tokenizer service: token ids exactly equal to vLLM's, much faster than plain HF.

Exactness rule
--------------
The ids returned are, for every input, the ids the engine computes:

* completions: ``tokenizer(prompt, add_special_tokens=True)`` (or the request's
  ``add_special_tokens``; a list of ints passes through after the engine's own validation: ints in
  ``[0, max_token_id]``);
* chat: the messages are first normalised exactly as vLLM's ``parse_chat_messages`` does (text
  parts joined with ``"\\n"`` for "string"-format templates, wrapped as ``{"type": "text"}`` parts
  for "openai"-format ones, only the fields vLLM forwards, tool-call arguments parsed to dicts),
  then rendered by transformers' own ``apply_chat_template(tokenize=False)`` with vLLM's kwargs
  (``add_generation_prompt``, ``continue_final_message``, filtered ``chat_template_kwargs``) and
  tokenized with ``add_special_tokens=False`` -- what ``apply_chat_template(tokenize=True)`` does
  (or the request's ``add_special_tokens``, as vLLM takes it);
* chat with media content parts (images, audio, video): the ids before the first item's
  placeholder, exact as far as they go (the rest is the engine's processor's: gateway.chat_messages).

Why the fast path is still exact
--------------------------------
1. Split at added tokens first. A Hugging Face ``tokenizers`` tokenizer extracts added tokens
   (special or not) from the raw text *before* normalisation and pre-tokenisation (leftmost-longest
   match; tokens with ``lstrip``/``rstrip``/``single_word`` flags change this, so we require them
   off), and then normalises, pre-tokenises and BPE-encodes every piece between them on its own.
   No merge, regex match or normaliser step ever crosses an added token. So
   ``encode(s0 + T1 + s1 + ...) == encode(s0) + [id(T1)] + encode(s1) + ...``: we do that split
   ourselves (same leftmost-longest rule) and the per-piece ids can be cached by piece text.
   This holds only for pre-tokenisers without position-dependent behaviour (e.g. Metaspace with
   ``prepend_scheme="first"`` looks at the piece's offset); ``token_backends.segment_safe`` admits a tokenizer
   only if its normaliser and pre-tokeniser are from a known position-free set.
2. tiktoken for the pieces. When the directory carries ``warmroute_tokenizer.json`` (BPE ranks +
   split regex + special tokens) and the HF tokenizer is exactly that vocabulary (same added
   tokens with the same ids, no flags, no normaliser, no tokens added by ``add_special_tokens``),
   pieces are encoded with ``tiktoken.encode_ordinary`` (Rust, releases the GIL, ~7x faster). Both
   run the same regex and the same rank-ordered byte-level BPE; the service re-checks this on a
   mixed sample at start-up and falls back to HF on any disagreement. Characters on which the two
   regex engines are known to differ (``_TIKTOKEN_UNSAFE``, found by an exhaustive scan of all code
   points in several contexts) send the piece to HF instead.
3. Nothing is normalised (no NFC/NFD), stripped or repaired. Text that is not valid Unicode
   (lone surrogates) is rejected with TokenizationError -- HF cannot encode it either.

Rendering is not cached: transformers renders an 8k-token conversation in ~35 us, far below the
cost of tokenizing, so a per-message render cache would add risk for no gain. Where the work runs
(`encode_*_auto`): on the caller's event loop when the text the segment cache does not hold is
short, else on the worker threads: a long prompt whose document is cached costs a dict lookup, and
a thread hop (~70 us of CPU: futures, wake-ups, GIL hand-offs) would cost more than the encoding.

Tests (tests/test_tokenization.py) compare against plain ``AutoTokenizer`` (hypothesis property
tests over random messages with special-token strings, unicode, whitespace runs) and against the
real engine's ``/tokenize`` captured in tests/fixtures.
"""
from __future__ import annotations

import asyncio
import copy
import functools
import json
import logging
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from gateway.chat_messages import (MEDIA_MARK, detect_content_format, has_media, hf_base_params, template_variables,
                                   to_conversation)
from gateway.default_tokenizer import default_tokenizer_dir
from gateway.token_backends import SegmentCache, load_tiktoken, segment_safe
from gateway.token_errors import TokenizationError, check_unicode

__all__ = ["TokenizationError", "TokenizerService", "SegmentCache", "detect_content_format"]

log = logging.getLogger(__name__)


# apply_chat_template kwargs that change tokenization rather than rendering: such requests take
# the plain HF path (tokenize=True), which is exact by construction.
_TOKENIZER_KWARGS = frozenset(
    {"padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
     "tokenizer_kwargs", "sanitize_control_tokens"}
)
# Code points where tiktoken's regex engine and HF's (onig) split differently for the shipped
# Qwen pattern: none found by the exhaustive scan (all 1,112,064 scalar values, each in a dozen contexts).
# Kept as a hook: a piece containing any of these is encoded by HF.
_TIKTOKEN_UNSAFE: frozenset[str] = frozenset()
_SELF_TEST_TEXT = (
    "Hello, world! ¿Qué tal? 数字 12345 678 <|im_start|>user\n  indented\tcode()\n\n\n"
    "It's I'M we'LL they'Re 'S 'ſ e\u0301 é ﬁ 😀👍🏽 👨‍👩‍👧 \u00a0\u2003x \r\n\r\n  \t\n"
    "def f(x):\n    return x**2  # comment\n<|im_end|><|endoftext|> العربية हिन्दी ру́сский\u200b\ufeff"
)


class TokenizerService:
    """Tokenize prompts and chats exactly as vLLM does, fast (see the module docstring).

    Thread-safe. Sync methods run in the caller's thread; the ``*_async`` ones in a private pool
    of ``max_workers`` threads (tiktoken and HF tokenizers release the GIL while encoding).
    """

    def __init__(
        self,
        tokenizer_dir: str | os.PathLike | None = None,
        *,
        max_workers: int = 1,
        segment_cache_entries: int = 8192,
        segment_cache_bytes: int = 256 * 2**20,
        backend: str = "auto",
        chat_template_content_format: str = "auto",
        default_chat_template_kwargs: dict | None = None,
        chat_template: str | None = None,
        interleave_mm_strings: bool = False,
    ) -> None:
        """`backend`: "auto" (tiktoken where provably equal, else HF), "tiktoken" (error if not
        possible) or "hf". `segment_cache_entries=0` disables the segment cache.
        `chat_template` / `chat_template_content_format` / `default_chat_template_kwargs` mirror the
        engine's `--chat-template` (a file, or the template itself, as vLLM reads it) /
        `--chat-template-content-format` / `--default-chat-template-kwargs`, and
        `interleave_mm_strings` its `--interleave-mm-strings` (gateway.chat_messages)."""
        if tokenizer_dir is None:
            tokenizer_dir = default_tokenizer_dir()
        self._dir = Path(tokenizer_dir)
        if backend not in ("auto", "tiktoken", "hf"):
            raise ValueError(f"backend must be auto, tiktoken or hf, got {backend!r}")
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError("chat_template_content_format must be auto, string or openai")
        self._content_format = chat_template_content_format
        self._interleave = interleave_mm_strings
        self._default_kwargs = dict(default_chat_template_kwargs or {})
        self._hf = AutoTokenizer.from_pretrained(str(self._dir))
        if chat_template:
            self._hf.chat_template = _load_template(chat_template)
        self._fast = getattr(self._hf, "backend_tokenizer", None)  # tokenizers.Tokenizer
        vocab = self._hf.get_vocab()
        self._max_token_id = max(vocab.values()) if vocab else -1
        self._cache = SegmentCache(segment_cache_entries, segment_cache_bytes)
        self._pool = ThreadPoolExecutor(max_workers=max(1, int(max_workers)), thread_name_prefix="warmroute-tok")
        self._closed = False
        self._slow_lock = threading.Lock()
        self._slow_hf = None  # private transformers copy for requests whose kwargs change tokenization
        tj = self._init_segments()
        self._tt = self._init_tiktoken(backend, tj)
        self._backend_name = "tiktoken" if self._tt is not None else "hf-tokenizers"

    def _init_segments(self) -> dict:
        """The added tokens as split points (module docstring, point 1); the parsed tokenizer.json."""
        hf = self._hf
        self._added = {t.content: i for i, t in hf.added_tokens_decoder.items()} if hasattr(hf, "added_tokens_decoder") else {}
        tj: dict = {}
        tj_path = self._dir / "tokenizer.json"
        if tj_path.exists():
            tj = json.loads(tj_path.read_text())
        safe, why = segment_safe(tj) if (self._fast is not None and tj) else (False, "no fast tokenizer.json")
        if getattr(hf, "split_special_tokens", False):
            safe, why = False, "tokenizer splits special tokens"
        self._segmented = safe
        if not safe:
            log.info("tokenizer %s: no per-segment caching (%s)", self._dir, why)
        added = self._added
        self._split_re = (
            re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
            if added else None
        )
        # BOS/EOS that add_special_tokens=True puts around a completion prompt (e.g. Llama's BOS).
        with_, without = self._hf_encode("a", True), self._hf_encode("a", False)
        self._adds_specials = with_ != without
        self.special_affixes = _affixes(with_, without)  # (ids before, ids after) a text's own
        return tj

    def _init_tiktoken(self, backend: str, tj: dict):
        """The tiktoken encoding when it provably equals HF on this vocabulary (point 2), else None."""
        if backend == "hf":
            return None
        enc, reason = load_tiktoken(self._dir)
        if enc is not None:
            reason = self._tiktoken_mismatch(enc, tj)
            if not reason:
                return enc
        if backend == "tiktoken":
            raise ValueError(f"tiktoken backend not usable for {self._dir}: {reason}")
        log.info("tokenizer %s: using HF tokenizers (%s)", self._dir, reason)
        return None

    # -- properties -------------------------------------------------------------------------

    @property
    def model_max_length(self) -> int:
        return int(self._hf.model_max_length)

    @property
    def vocab_size(self) -> int:
        """Number of valid ids (largest id + 1, added tokens included)."""
        return self._max_token_id + 1

    @property
    def tokenizer_dir(self) -> Path:
        return self._dir

    @property
    def backend_name(self) -> str:
        return self._backend_name

    @property
    def segment_cache(self) -> SegmentCache:
        return self._cache

    @property
    def hf_tokenizer(self):
        """The transformers tokenizer (reference; slow)."""
        return self._hf

    # -- checks -----------------------------------------------------------------------------

    def _tiktoken_mismatch(self, enc, tj: dict) -> str:
        if not self._segmented:
            return "tokenizer not segment-safe"
        if tj.get("normalizer") is not None:
            return "tokenizer.json has a normalizer"
        if self._adds_specials:
            return "add_special_tokens adds tokens"
        if dict(enc._special_tokens) != self._added:
            return "special tokens differ from the HF added tokens"
        if enc.n_vocab != self.vocab_size:
            return f"vocabulary sizes differ ({enc.n_vocab} vs {self.vocab_size})"
        sample = _SELF_TEST_TEXT * 2
        if enc.encode(sample, allowed_special="all") != self._hf_encode(sample, False):
            return "tiktoken and HF disagree on the self-test sample"
        return ""

    # -- encoding core ----------------------------------------------------------------------

    def _hf_encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            if self._fast is not None:
                return self._fast.encode(text, add_special_tokens=add_special_tokens).ids
            return list(self._hf(text, add_special_tokens=add_special_tokens)["input_ids"])
        except (TypeError, ValueError) as e:  # e.g. lone surrogates
            raise TokenizationError(f"cannot tokenize text: {e}") from None

    def _encode_piece(self, piece: str) -> list[int]:
        """Ids of a piece that contains no added token."""
        tt = self._tt
        if tt is not None and not (_TIKTOKEN_UNSAFE and any(c in _TIKTOKEN_UNSAFE for c in piece)):
            return tt.encode_ordinary(piece)
        return self._hf_encode(piece, False)

    def _pieces(self, text: str, add_special_tokens: bool) -> list[str] | None:
        """`text` split at added tokens (piece, token, piece, ...), or None when it is encoded whole."""
        if not self._segmented or (add_special_tokens and self._adds_specials):
            return None
        return self._split_re.split(text) if self._split_re is not None else [text]

    def _uncached_chars(self, pieces: list[str] | None, text: str) -> int:
        """Characters of `text` that the segment cache does not hold (what encoding it would cost)."""
        if pieces is None or not self._cache.enabled:
            return len(text)
        held = self._cache.holds
        return sum(len(p) for p in pieces[::2] if p and not held(p))

    def _encode_text(self, text: str, add_special_tokens: bool, pieces: list[str] | None = None) -> list[int]:
        if pieces is None:
            pieces = self._pieces(text, add_special_tokens)
            if pieces is None:
                check_unicode(text)
                return self._hf_encode(text, add_special_tokens)
        added = self._added
        out: list[int] = []
        cache = self._cache
        use_cache = cache.enabled
        # re.split with one capture group alternates: piece, token, piece, token, ..., piece
        for k, piece in enumerate(pieces):
            if k & 1:
                out.append(added[piece])
                continue
            if not piece:
                continue
            ids = cache.get(piece) if use_cache else None
            if ids is None:
                check_unicode(piece)
                ids = self._encode_piece(piece)
                if use_cache:
                    cache.put(piece, ids)
            out += ids
        return out

    async def _encode_text_auto(self, text: str, add_special_tokens: bool, inline_max_chars: int) -> list[int]:
        """Encode on the caller's loop when at most `inline_max_chars` are not in the segment cache
        (a repeated document costs a lookup there, less than a thread hop), else on the pool."""
        pieces = self._pieces(text, add_special_tokens)
        if self._uncached_chars(pieces, text) <= inline_max_chars:
            return self._encode_text(text, add_special_tokens, pieces)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._encode_text, text,
                                                                add_special_tokens, pieces)

    # -- public API -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TokenizerService is closed")

    def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Ids of a completions prompt (add_special_tokens=True, vLLM's default), or validated ids passed through."""
        self._check_open()
        if isinstance(prompt, str):
            return self._encode_text(prompt, add_special_tokens)
        if isinstance(prompt, (list, tuple)):
            limit = self._max_token_id
            for i, t in enumerate(prompt):
                if type(t) is not int:
                    raise TokenizationError(f"prompt[{i}] must be an integer token id, got {type(t).__name__}")
                if t < 0 or t > limit:
                    raise TokenizationError(f"token id {t} at prompt[{i}] is out of vocabulary (0..{limit})")
            return list(prompt)
        raise TokenizationError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def render_chat(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list | None = None,
    ) -> str:
        """The prompt text vLLM renders for these messages (with media parts: the text before the first)."""
        text, _ = self._render(messages, add_generation_prompt, continue_final_message, chat_template_kwargs, tools)
        if text is None:
            raise TokenizationError("these chat_template_kwargs change tokenization; no plain text rendering")
        return text

    def _render(self, messages, add_generation_prompt, continue_final_message, chat_template_kwargs, tools, *,
                whole: bool = False):
        """(text, None), or (None, ids) when transformers must tokenize; with media parts the text
        before the first item's placeholder, or `whole`: all of it, each item a MEDIA_MARK."""
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TokenizationError("chat_template_kwargs must be an object")
        if tools is not None and not isinstance(tools, list):
            raise TokenizationError("tools must be a list")
        if add_generation_prompt and continue_final_message:
            raise TokenizationError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        # vLLM: server defaults < request chat_template_kwargs < request fields (None/"auto" unset)
        # (vLLM's merge_kwargs drops None/"auto" request values only when server defaults are set)
        kwargs = dict(chat_template_kwargs or {})
        if self._default_kwargs:
            kwargs = {**self._default_kwargs, **{k: v for k, v in kwargs.items() if v is not None and v != "auto"}}
        kwargs["add_generation_prompt"] = bool(add_generation_prompt)
        kwargs["continue_final_message"] = bool(continue_final_message)
        bad = {"chat_template", "tokenize"} & kwargs.keys()
        if bad:
            raise TokenizationError(f"Found unexpected chat template kwargs from request: {sorted(bad)}")
        try:
            template = self._hf.get_chat_template(None, tools)
        except Exception as e:
            raise TokenizationError(f"no chat template: {e}") from None
        accept = (template_variables(template) | hf_base_params()) - {"chat_template", "tokenize"}
        kwargs = {k: v for k, v in kwargs.items() if k in accept}
        fmt = self._format_of(template)
        conversation = to_conversation(messages, fmt, interleave=self._interleave)
        tok_kwargs = _TOKENIZER_KWARGS & kwargs.keys()
        media = has_media(messages)
        if tok_kwargs and media:
            raise TokenizationError(f"chat_template_kwargs {sorted(tok_kwargs)} with media content parts are not supported")
        try:
            if tok_kwargs:  # rare: let transformers tokenize itself (exact by construction)
                kwargs.pop("return_dict", None)
                # truncation/padding kwargs mutate the backend tokenizer: use a private copy, serialised
                with self._slow_lock:
                    if self._slow_hf is None:
                        self._slow_hf = copy.deepcopy(self._hf)
                    ids = self._slow_hf.apply_chat_template(
                        conversation, tools=tools, tokenize=True, return_dict=False, **kwargs
                    )
                if not (isinstance(ids, list) and all(type(t) is int for t in ids)):
                    raise TokenizationError(f"unsupported chat_template_kwargs {sorted(tok_kwargs)}")
                return None, ids
            text = self._hf.apply_chat_template(conversation, tools=tools, tokenize=False, **kwargs)
        except TokenizationError:
            raise
        except Exception as e:  # jinja errors, raise_exception() in templates, continue_final_message...
            raise TokenizationError(f"chat template error: {e}") from None
        if not isinstance(text, str):
            raise TokenizationError("chat template did not render to text")
        if media and not whole:  # the text before the first media item's placeholder (gateway.chat_messages)
            text = text.partition(MEDIA_MARK)[0]
        return text, None

    def encode_chat(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list | None = None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Ids of a chat request as vLLM computes them (template applied, add_special_tokens=False);
        with media content parts, those before the first item's placeholder (gateway.chat_messages).

        `add_generation_prompt` / `continue_final_message` are the request's top-level fields; they
        override the same keys in `chat_template_kwargs`, as in vLLM. `tools` as vLLM passes them
        to the template (the request's tool definitions, or None when tools are excluded).
        """
        self._check_open()
        text, ids = self._render(messages, add_generation_prompt, continue_final_message, chat_template_kwargs, tools)
        if ids is not None:
            return ids
        return self._encode_text(text, add_special_tokens)

    async def encode_prompt_async(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        self._check_open()
        if not isinstance(prompt, str):  # validation only: not worth a thread hop
            return self.encode_prompt(prompt)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.encode_prompt, prompt, add_special_tokens)

    async def encode_chat_async(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list | None = None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        self._check_open()
        fn = functools.partial(
            self.encode_chat, messages, add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs, tools=tools,
            continue_final_message=continue_final_message, add_special_tokens=add_special_tokens,
        )
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def encode_prompt_auto(self, prompt: str | list[int], *, inline_max_chars: int,
                                 add_special_tokens: bool = True) -> list[int]:
        """`encode_prompt`, on the loop or the pool by what is left to encode (`_encode_text_auto`)."""
        self._check_open()
        if not isinstance(prompt, str):
            return self.encode_prompt(prompt)
        return await self._encode_text_auto(prompt, add_special_tokens, inline_max_chars)

    async def encode_chat_auto(
        self,
        messages: list[dict],
        *,
        inline_max_chars: int,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list | None = None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """`encode_chat`, rendered on the loop (the template holds the GIL wherever it runs) and
        encoded on the loop or the pool by what the segment cache leaves to encode
        (`_encode_text_auto`). With tools, or kwargs that make transformers tokenize itself, all of
        it runs on the pool as `encode_chat_async`."""
        self._check_open()
        kw = dict(add_generation_prompt=add_generation_prompt, chat_template_kwargs=chat_template_kwargs, tools=tools,
                  continue_final_message=continue_final_message, add_special_tokens=add_special_tokens)
        ctk = chat_template_kwargs if isinstance(chat_template_kwargs, dict) else {}
        if tools or _TOKENIZER_KWARGS & (ctk.keys() | self._default_kwargs.keys()):
            return await self.encode_chat_async(messages, **kw)
        text, ids = self._render(messages, add_generation_prompt, continue_final_message, chat_template_kwargs, tools)
        if ids is not None:
            return ids
        return await self._encode_text_auto(text, add_special_tokens, inline_max_chars)

    async def encode_chat_cut(self, messages: list[dict], *, inline_max_chars: int, add_generation_prompt: bool = True,
                              chat_template_kwargs: dict | None = None, tools: list | None = None,
                              continue_final_message: bool = False,
                              add_special_tokens: bool = False) -> tuple[list[int], int, int]:
        """A chat with media parts as `encode_chat` keys it, and what the engine's prompt has past
        that: (the ids before the first item's placeholder, the text tokens after it, the items).
        The engine's prompt is about those plus each item's own tokens (gateway.encode)."""
        self._check_open()
        text, ids = self._render(messages, add_generation_prompt, continue_final_message, chat_template_kwargs, tools,
                                 whole=True)
        if text is None:  # kwargs that make transformers tokenize (refused there with media parts)
            return ids, 0, 0
        items = text.count(MEDIA_MARK)
        head, _, rest = text.partition(MEDIA_MARK)
        ids = await self._encode_text_auto(head, add_special_tokens, inline_max_chars)
        after = await self._encode_text_auto(rest.replace(MEDIA_MARK, ""), False, inline_max_chars) if rest else []
        return ids, len(after), items

    def media_in_part_order(self, tools: list | None = None) -> bool:
        """Does the engine place a chat's media items in their parts' order (an "openai" template,
        or --interleave-mm-strings), rather than first in their message (gateway.chat_messages)?"""
        if self._interleave:
            return True
        if self._content_format != "auto":
            return self._content_format == "openai"
        try:
            return self._format_of(self._hf.get_chat_template(None, tools)) == "openai"
        except Exception:  # no template: the request fails in encoding; vLLM's fallback is "string"
            return False

    def _format_of(self, template: str) -> str:
        """The content format vLLM renders `template` with: the one set, else detected."""
        return self._content_format if self._content_format != "auto" else detect_content_format(template)

    def warm_up(self) -> None:
        """Render and encode one short chat (and plain text) now, so the first request does not pay
        for compiling the chat template and reading it for its variables (~5-20 ms once, off the
        event loop when called where the service is built). A template that refuses the sample
        (one that needs a system message first, say) is left cold: no error."""
        self.encode_prompt("warm-up")
        try:
            self.encode_chat([{"role": "user", "content": "warm-up"}])
        except TokenizationError:
            pass

    def close(self) -> None:
        """Stop the thread pool (waits for running work) and drop the cache. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._cache.clear()

    def __enter__(self) -> "TokenizerService":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TokenizerService({str(self._dir)!r}, backend={self._backend_name!r}, segmented={self._segmented})"


def _affixes(with_specials: list[int], without: list[int]) -> tuple[int, int]:
    """How many ids add_special_tokens puts before and after a text's own (Llama's BOS: (1, 0))."""
    n = len(without)
    for k in range(len(with_specials) - n + 1):
        if with_specials[k:k + n] == without:
            return k, len(with_specials) - k - n
    return 0, 0


def _load_template(chat_template: str) -> str:
    """vLLM's --chat-template: a file's text, else the argument itself when it reads as a template."""
    try:
        return Path(chat_template).read_text()
    except OSError:
        if any(c in chat_template for c in "{}\n"):
            return chat_template
        raise ValueError(f"chat template file not found: {chat_template}") from None
