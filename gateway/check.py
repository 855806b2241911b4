"""`warmroute check`: one deployed gateway's (or Endpoint Picker's) readiness and answers, step by
step (gateway.check_cli says what the steps are). The judgments are pure (`judge_*`: a status and
a parsed body -> a Step); `run_check` does the HTTP and prints. Never prints the API key.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import httpx

__all__ = ["Step", "judge_ready", "judge_models", "judge_completion", "run_check", "main_from_args"]


@dataclass(frozen=True)
class Step:
    name: str
    ok: bool
    detail: str
    model: str | None = None  # the listing's first model (the completion asks it)

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name}: {self.detail}"


def judge_ready(status: int, body) -> Step:
    if status == 200:
        degraded = body.get("degraded") if isinstance(body, dict) else None
        return Step("ready", True, "ready" + (f" (degraded: {'; '.join(degraded)})" if degraded else ""))
    reasons = body.get("reasons") if isinstance(body, dict) else None
    return Step("ready", False, f"HTTP {status}" + (f": {'; '.join(reasons)}" if reasons else ""))


def _error_message(body) -> str | None:
    """The message of an OpenAI-shaped error body, else None."""
    err = body.get("error") if isinstance(body, dict) else None
    return err.get("message") if isinstance(err, dict) and isinstance(err.get("message"), str) else None


def judge_models(status: int, body, keyed: bool) -> Step:
    if status == 200:
        data = body.get("data") if isinstance(body, dict) else None
        ids = [m.get("id") for m in data or () if isinstance(m, dict) and isinstance(m.get("id"), str)]
        if not ids:
            return Step("models", False, "HTTP 200 without any model listed")
        return Step("models", True, f"{len(ids)} listed: {', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''}", ids[0])
    message = _error_message(body)
    if status == 401 and not keyed and message is not None:
        return Step("models", True, "auth enforced (401 without a key; give one to check a completion)")
    return Step("models", False, f"HTTP {status}" + (f": {message}" if message else " (not OpenAI's error shape)"))


def judge_completion(status: int, body) -> Step:
    choices = body.get("choices") if isinstance(body, dict) else None
    if status == 200 and choices:
        return Step("completion", True, "one token answered")
    message = _error_message(body)
    return Step("completion", False, f"HTTP {status}" + (f": {message}" if message else ""))


def _json(r: httpx.Response):
    try:
        return r.json()
    except ValueError:
        return None


def _wait_ready(client: httpx.Client, admin_url: str, timeout_s: float) -> Step:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = client.get(admin_url.rstrip("/") + "/readyz")
            step = judge_ready(r.status_code, _json(r))
        except httpx.HTTPError as exc:
            step = Step("ready", False, f"{type(exc).__name__}: {exc}")
        if step.ok or time.monotonic() >= deadline:
            return step
        time.sleep(1.0)


def run_check(admin_url: str, url: str | None, api_key: str | None, timeout_s: float,
              out: Callable[[str], None] = print) -> bool:
    """The steps in order, each printed as it ends; True when every step passed."""
    steps: list[Step] = []

    def record(step: Step) -> bool:
        steps.append(step)
        out(step.line())
        return step.ok

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=timeout_s) as client:
        if not record(_wait_ready(client, admin_url, timeout_s)) or url is None:
            return all(s.ok for s in steps)
        base = url.rstrip("/")
        try:
            r = client.get(base + "/v1/models", headers=headers)
            models = judge_models(r.status_code, _json(r), bool(api_key))
        except httpx.HTTPError as exc:
            models = Step("models", False, f"{type(exc).__name__}: {exc}")
        if record(models) and models.model is not None:
            try:
                r = client.post(base + "/v1/completions", headers=headers,
                                json={"model": models.model, "prompt": "warmroute check", "max_tokens": 1})
                record(judge_completion(r.status_code, _json(r)))
            except httpx.HTTPError as exc:
                record(Step("completion", False, f"{type(exc).__name__}: {exc}"))
    return all(s.ok for s in steps)


def main_from_args(args) -> int:
    key = os.environ.get(args.api_key_env) or None
    ok = run_check(args.admin_url, args.url, key, args.timeout)
    sys.stdout.flush()
    return 0 if ok else 1
