"""What real vLLM (the CPU build) does with a chat that carries images, on a tiny random-weight
Qwen2-VL: the prompt's token ids (`return_token_ids`) and the cached tokens it reports, for a
"openai"-format chat template (the image's place kept among the parts) and a "string" one (vLLM
puts the placeholders first in the message). The fixture it writes is what
tests/test_multimodal_parity.py checks the gateway's tokenizer against (gateway.chat_messages:
the text before the first media item).

Not run in CI: vLLM's Qwen2-VL imports torchvision, which the CPU build's venv does not carry
(setup_vllm.sh removes the builds pip brings beside its torch, which break its imports). Give it
one that imports (`--pydeps DIR`, put on the engine's PYTHONPATH); `--torchvision-wheel WHEEL`
makes one from a wheel of the matching version (0.28.0 for torch 2.13): installed there without
dependencies, its fake-op registrations made conditional on its compiled ops, which a wheel built
for another device lacks (vLLM's image processing needs none of them). From the repo root:

    python tests/real_vllm/multimodal_probe.py tests/fixtures/vllm-0.32-multimodal.json \\
        --pydeps /tmp/wr-tv --torchvision-wheel torchvision-0.28.0-cp311-cp311-manylinux_2_28_x86_64.whl

Each template's engine starts fresh (about a minute on 2 cores) and is stopped at the end.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from tests.real_vllm.launch import Replica, _free_ports, vllm_python  # noqa: E402

VL_SPECIALS = ["<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
               "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
VISION_START, IMAGE_PAD = 151652, 151655  # Qwen2-VL's ids, which the specials above get after the 3 ChatML ones
TEMPLATES = {
    # the image's place kept: the template renders each part in order (Qwen2-VL's own way)
    "openai": ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
               "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
               "{% for content in message['content'] %}"
               "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
               "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
               "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    # content as one string: vLLM puts the placeholders first in the message
    "string": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
}
SYSTEM = ("You describe images for a museum catalogue: the dominant colours, the shapes and their places, any "
          "legible text and the likely medium, in short neutral sentences, one fact each, British spelling, no "
          "guesses at names, dates or places that the image does not show. ") * 4


def build_tokenizer(out: Path, template: str) -> Path:
    """The project's default tokenizer (Qwen's vocabulary, ChatML) with Qwen2-VL's specials and
    `template`: the engine's and the gateway's (transformers only, either venv)."""
    from transformers import AutoTokenizer

    from gateway.default_tokenizer import default_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(str(default_tokenizer_dir()))
    tok.add_special_tokens({"extra_special_tokens": VL_SPECIALS}, replace_extra_special_tokens=False)
    if tok.convert_tokens_to_ids(VL_SPECIALS) != list(range(151646, 151657)):
        raise SystemExit("the vision specials did not get Qwen2-VL's ids")
    tok.chat_template = TEMPLATES[template]
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    (out / "chat_template.jinja").write_text(TEMPLATES[template])
    return out


def build_model(out: Path, template: str) -> None:
    """A tiny Qwen2-VL with random weights (seed 0) and an image processor that makes an image a
    few dozen tokens (vLLM's venv: torch)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    build_tokenizer(out, template)
    Qwen2VLImageProcessor(size={"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 36}, patch_size=14,
                          temporal_patch_size=2, merge_size=2).save_pretrained(str(out))
    text = dict(vocab_size=151936, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=8192, rms_norm_eps=1e-6, bos_token_id=151643,
                eos_token_id=151645, pad_token_id=151643, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]})
    vision = dict(depth=1, embed_dim=64, hidden_size=128, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_PAD, video_token_id=151656,
                        vision_start_token_id=VISION_START, vision_end_token_id=151653, tie_word_embeddings=True,
                        dtype="float32")
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(cfg).to(torch.float32).save_pretrained(str(out))


def make_pydeps(target: Path, wheel: str) -> None:
    """torchvision from `wheel` into `target`, importable beside the CPU build's torch (module header)."""
    subprocess.run([str(vllm_python()), "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), wheel],
                   check=True)
    meta = target / "torchvision" / "_meta_registrations.py"
    src = meta.read_text()
    src = re.sub(r'@torch\.library\.register_fake\(("torchvision::\w+")\)',
                 r"@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))", src)
    meta.write_text(src)


def image(color: tuple[int, int, int], mark: int) -> dict:
    """A 160x120 PNG (24 image tokens) as a data URL part; `mark` draws a different shape."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (160, 120), color)
    ImageDraw.Draw(im).rectangle([10 + 20 * mark, 10, 60 + 20 * mark, 70], fill=(255, 255, 255))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}


def cases() -> list[tuple[str, list]]:
    """(label, user content), sent in order to a fresh engine after the system prompt."""
    a, b, c = image((200, 30, 30), 0), image((30, 160, 40), 1), image((20, 40, 200), 2)
    ask = {"type": "text", "text": "Describe it."}
    before = {"type": "text", "text": "Please look at the following picture and describe it."}
    return [("image a, text", [a, ask]), ("image b, text", [b, ask]), ("image a, text, again", [a, ask]),
            ("text only", "Describe it."), ("text, image c", [before, c]), ("text, image a", [before, a]),
            ("image a, image b", [a, b, ask])]


def probe(template: str, pydeps: Path, work: Path) -> list[dict]:
    model = work / f"model-{template}"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    subprocess.run([str(vllm_python()), __file__, "--build", str(model), "--template", template], check=True,
                   env={**env, "PYTHONPATH": f"{REPO}:{pydeps}"})
    port, events, replay = _free_ports(3)
    rep = Replica(f"vl-{template}", model, "tiny-vl", port, events, replay, work / f"vl-{template}.log", vllm_python(),
                  extra_args=["--limit-mm-per-prompt", json.dumps({"image": 2})],
                  extra_env={"PYTHONPATH": str(pydeps)})
    rep.start()
    out = []
    try:
        for label, content in cases():
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
            body = {"model": "tiny-vl", "messages": messages, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
            req = urllib.request.Request(rep.url + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                got = json.loads(r.read())
            ids = got["prompt_token_ids"]
            out.append({"template": template, "label": label, "messages": messages, "prompt_token_ids": ids,
                        "cached_tokens": got["usage"]["prompt_tokens_details"]["cached_tokens"]})
            print(f"{template:6} {label:22} prompt {len(ids):4}  first image pad at "
                  f"{ids.index(IMAGE_PAD) if IMAGE_PAD in ids else '-':>4}  cached {out[-1]['cached_tokens']}")
    finally:
        rep.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("fixture", nargs="?", help="the fixture to write")
    ap.add_argument("--pydeps", type=Path, help="a directory with an importable torchvision (module header)")
    ap.add_argument("--torchvision-wheel", help="make --pydeps from this wheel first (default: use it as it is)")
    ap.add_argument("--build", type=Path, help=argparse.SUPPRESS)  # inside vLLM's venv: write one model
    ap.add_argument("--template", choices=sorted(TEMPLATES), default="openai", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.build:
        build_model(a.build, a.template)
        return
    if not (a.fixture and a.pydeps):
        ap.error("give the fixture to write and --pydeps")
    if a.torchvision_wheel:
        make_pydeps(a.pydeps, a.torchvision_wheel)
    from gateway.default_tokenizer import default_tokenizer_dir

    default_tokenizer_dir()  # built here (the project's venv has what building it needs), read by the engine's
    work = Path(tempfile.mkdtemp(prefix="wr-multimodal-"))
    try:
        rows = [row for t in ("openai", "string") for row in probe(t, a.pydeps, work)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    version = subprocess.run([str(vllm_python()), "-c", "import vllm; print(vllm.__version__)"], check=True,
                             capture_output=True, text=True).stdout.strip()
    Path(a.fixture).write_text(json.dumps({"vllm": version, "block_size": 32, "cases": rows}, indent=1) + "\n")
    print("wrote", a.fixture)


if __name__ == "__main__":
    main()
