"""What vLLM does with a chat or completions body's fields that change what it renders or what it
reports cached: the chat template's options (`build_chat_params`: `chat_template_kwargs` merged
with `documents`, `reasoning_effort` and the `enable_thinking` it implies), and whether the request
reads the prefix cache at all (`SamplingParams.skip_reading_prefix_cache`, set when it asks for
prompt logprobs). No engine started. Run with vLLM's Python, from the repo root, to regenerate the
fixture gateway/parse.py is tested against (tests/test_request_params.py):

    ~/.cache/warmroute/vllm-venv/bin/python tests/real_vllm/request_params_probe.py \\
        tests/fixtures/vllm-0.32-request-params.json

It reads the bodies from that file's `cases` and writes the file again with vLLM's answers."""
from __future__ import annotations

import json
import sys

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest


def answer(case: dict) -> dict:
    kind, body = case["kind"], case["body"]
    out = {"kind": kind, "body": body}
    try:
        if kind == "chat":
            req = ChatCompletionRequest(**body)
            out["chat_template_kwargs"] = req.build_chat_params(None, "auto").chat_template_kwargs
        else:
            req = CompletionRequest(**body)
        sp = req.to_sampling_params(16, {})
    except Exception as e:  # noqa: BLE001 - vLLM refuses the body: record which error
        return {**out, "error": type(e).__name__}
    return {**out, "skip_reading_prefix_cache": bool(sp.skip_reading_prefix_cache), "n": sp.n}


def main(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    data["cases"] = [answer(c) for c in data["cases"]]
    data["vllm"] = __import__("vllm").__version__
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
