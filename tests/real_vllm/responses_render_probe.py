"""What vLLM hands its chat template for each Responses API body: the messages, tools and template
options its own functions build (no engine started). Run with vLLM's Python, from the repo root,
to regenerate the fixture gateway/responses_api.py is tested against (tests/test_responses_api.py):

    ~/.cache/warmroute/vllm-venv/bin/python tests/real_vllm/responses_render_probe.py \\
        tests/fixtures/vllm-0.32-responses-render.json

It reads the bodies from that file's `cases` and writes the file again with vLLM's answers."""
from __future__ import annotations

import json
import sys

from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts



def plain(x):
    """Pydantic models and containers of them as JSON-able data."""
    if hasattr(x, "model_dump"):
        return x.model_dump()
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


def conv(body: dict) -> dict:
    """vLLM's rendering inputs for one body, or the name of the error it raises."""
    try:
        req = ResponsesRequest(**body)
        msgs = construct_input_messages(request_instructions=req.instructions, request_input=req.input)
        tools = construct_tool_dicts(req.tools, req.tool_choice)
        params = req.build_chat_params(None, "auto")
    except Exception as e:
        return {"body": body, "error": type(e).__name__}
    return {"body": body, "messages": plain(msgs), "tools": plain(tools),
            "chat_template_kwargs": plain(params.chat_template_kwargs)}


if __name__ == "__main__":
    path = sys.argv[1]
    with open(path) as f:
        bodies = [c["body"] for c in json.load(f)["cases"]]
    out = {"vllm": __import__("vllm").__version__, "cases": [conv(b) for b in bodies]}
    with open(path, "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
