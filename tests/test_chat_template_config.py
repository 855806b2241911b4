"""The engines' chat-template flags in the gateway's config (`model.chat_template`,
`model.chat_template_content_format`, `model.default_chat_template_kwargs`: vLLM's --chat-template,
--chat-template-content-format and --default-chat-template-kwargs): the gateway's tokenizer renders
with them as the engine does, and a wrong value stops the gateway at start naming the field."""
from __future__ import annotations

import pytest

from gateway.config import ConfigError, check_files, config_from_dict
from gateway.server import Gateway

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}{% if enable_thinking is defined and not enable_thinking %}"
            ":quiet{% endif %}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def _cfg(**model):
    return config_from_dict({"server": {"port": 0, "admin_port": 0}, "membership": {"replicas": ["r0=http://127.0.0.1:9"]},
                             "auth": {"enabled": False}, "feed": {"url": "memory://chat-template-config"},
                             "model": model}, env={})


def test_the_tokenizer_renders_with_the_engines_template_and_default_kwargs(tmp_path):
    from transformers import AutoTokenizer

    from gateway.default_tokenizer import default_tokenizer_dir

    path = tmp_path / "tool_chat_template.jinja"
    path.write_text(TEMPLATE)
    msgs = [{"role": "user", "content": "Which clause?"}]
    hf = AutoTokenizer.from_pretrained(str(default_tokenizer_dir()))
    for model, kwargs in (({"chat_template": str(path)}, {}),
                          ({"chat_template": TEMPLATE, "default_chat_template_kwargs": {"enable_thinking": False}},
                           {"enable_thinking": False})):
        tok = Gateway(_cfg(**model))._load_tokenizer()
        try:
            want = hf.apply_chat_template(msgs, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False, **kwargs)
            assert "[user" in want and tok.encode_chat(msgs) == hf(want, add_special_tokens=False)["input_ids"]
            assert (":quiet" in want) == bool(kwargs)  # the default kwargs reached the template
            # a request's own kwargs override the engine's defaults, as in vLLM
            assert tok.encode_chat(msgs, chat_template_kwargs={"enable_thinking": True}) == hf(
                hf.apply_chat_template(msgs, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False,
                                       enable_thinking=True), add_special_tokens=False)["input_ids"]
        finally:
            tok.close()


def test_interleaved_media_placeholders_cut_where_the_part_is():
    """`model.interleave_mm_strings` (vLLM's --interleave-mm-strings): a "string" template gets an
    image's placeholder in its part's place among the texts, not first in the message, so the
    keyed text runs on to it."""
    from transformers import AutoTokenizer

    from gateway.default_tokenizer import default_tokenizer_dir

    hf = AutoTokenizer.from_pretrained(str(default_tokenizer_dir()))
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Compare this"}, image, {"type": "text", "text": "with"}, image]}]
    for interleave, before in ((False, ""), (True, "Compare this\n")):
        tok = Gateway(_cfg(interleave_mm_strings=interleave))._load_tokenizer()
        try:
            want = hf.apply_chat_template([{"role": "user", "content": "\u2603"}], add_generation_prompt=True, tokenize=False)
            want = want[:want.index("\u2603")] + before
            assert tok.encode_chat(msgs) == hf(want, add_special_tokens=False)["input_ids"], interleave
        finally:
            tok.close()


def test_a_wrong_value_names_its_field(tmp_path):
    with pytest.raises(ConfigError, match="model.chat_template"):
        check_files(_cfg(chat_template=str(tmp_path / "missing.jinja")))
    with pytest.raises(ConfigError, match="model.chat_template_content_format"):
        _cfg(chat_template_content_format="markdown")
    with pytest.raises(ConfigError, match="model.default_chat_template_kwargs"):
        _cfg(default_chat_template_kwargs={"tokenize": True})
