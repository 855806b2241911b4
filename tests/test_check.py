"""`warmroute check` (gateway.check): the judgments without sockets, then the whole check against
a running embedded system (simulated replicas, agents, a gateway with API keys), with a key,
without one (auth enforced passes, the completion is skipped), and against nothing."""
from __future__ import annotations

import asyncio

from gateway.check import judge_completion, judge_models, judge_ready, run_check
from gateway.cli import main
from loadtests.harness import EmbeddedSystem, SystemSpec
from tests.conftest import free_port


def test_judgments():
    assert judge_ready(200, {"ready": True, "reasons": [], "degraded": []}).ok
    assert "degraded: feed lagging" in judge_ready(200, {"degraded": ["feed lagging"]}).detail
    bad = judge_ready(503, {"ready": False, "reasons": ["no replica available", "draining"]})
    assert not bad.ok and bad.detail == "HTTP 503: no replica available; draining"
    assert not judge_ready(502, None).ok
    listed = judge_models(200, {"object": "list", "data": [{"id": "m"}, {"id": "lora-a"}]}, keyed=True)
    assert listed.ok and listed.model == "m" and "2 listed" in listed.detail
    assert not judge_models(200, {"data": []}, keyed=True).ok
    refused = {"error": {"message": "missing API key", "type": "authentication_error"}}
    assert judge_models(401, refused, keyed=False).ok and judge_models(401, refused, keyed=False).model is None
    assert not judge_models(401, refused, keyed=True).ok  # a key was given and refused
    assert not judge_models(401, "Unauthorized", keyed=False).ok  # not OpenAI's error shape: not our gateway
    assert judge_completion(200, {"choices": [{"text": "x"}]}).ok
    assert not judge_completion(200, {"choices": []}).ok
    assert judge_completion(503, {"error": {"message": "no replica"}}).detail == "HTTP 503: no replica"


async def test_against_a_running_gateway(capsys, monkeypatch):
    async with EmbeddedSystem(SystemSpec(replicas=1, num_blocks=128, tenants=("t0",))) as system:
        key = system.api_keys["t0"]
        lines: list[str] = []
        ok = await asyncio.to_thread(run_check, system.admin_url, system.url, key, 30.0, lines.append)
        assert ok, lines
        assert [ln.split(":")[0] for ln in lines] == ["ok   ready", "ok   models", "ok   completion"]
        lines.clear()
        ok = await asyncio.to_thread(run_check, system.admin_url, system.url, None, 30.0, lines.append)
        assert ok and len(lines) == 2 and "auth enforced" in lines[1], lines
        lines.clear()
        ok = await asyncio.to_thread(run_check, system.admin_url, system.url, "sk-not-a-key", 30.0, lines.append)
        assert not ok and lines[1].startswith("FAIL models: HTTP 401"), lines
        monkeypatch.setenv("CHECK_KEY", key)
        rc = await asyncio.to_thread(main, ["check", "--admin-url", system.admin_url, "--url", system.url,
                                            "--api-key-env", "CHECK_KEY", "--timeout", "30"])
        out = capsys.readouterr().out
        assert rc == 0 and out.count("ok   ") == 3, out
        assert key not in out and key not in "".join(lines)


def test_nothing_listening_fails_after_the_timeout():
    lines: list[str] = []
    assert not run_check(f"http://127.0.0.1:{free_port()}", None, None, 1.0, lines.append)
    assert len(lines) == 1 and lines[0].startswith("FAIL ready: ConnectError"), lines
