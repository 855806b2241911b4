"""What vLLM hands its chat template for each Responses API body: the messages, tools and template
options its own functions build (no engine started). Run with vLLM's Python, from the repo root,
to regenerate the fixture gateway/responses_api.py is tested against (tests/test_responses_api.py):

    ~/.cache/warmroute/vllm-venv/bin/python tests/real_vllm/responses_render_probe.py \\
        tests/fixtures/vllm-0.32-responses-render.json

It reads the bodies from that file's `cases` and writes the file again with vLLM's answers; its
`followups` likewise: each a body with `previous_response_id`, and the previous response as vLLM
stored it (the messages it was rendered from, its output items), rendered as vLLM renders a
follow-up (`construct_input_messages` with `prev_msg` and `prev_response_output`)."""
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


def followup(case: dict) -> dict:
    """vLLM's messages for a follow-up to the stored response `case["previous"]`."""
    from openai.types.responses import ResponseOutputItem
    from pydantic import TypeAdapter

    body, prev = case["body"], case["previous"]
    try:
        req = ResponsesRequest(**body)
        outputs = [TypeAdapter(ResponseOutputItem).validate_python(o) for o in prev["output"]]
        msgs = construct_input_messages(request_instructions=req.instructions, request_input=req.input,
                                        prev_msg=list(prev["messages"]), prev_response_output=outputs)
    except Exception as e:
        return {"body": body, "previous": prev, "error": type(e).__name__}
    return {"body": body, "previous": prev, "messages": plain(msgs)}


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
        old = json.load(f)
    out = {"vllm": __import__("vllm").__version__, "cases": [conv(c["body"]) for c in old["cases"]],
           "followups": [followup({"body": c["body"], "previous": c["previous"]}) for c in old.get("followups", [])]}
    with open(path, "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
