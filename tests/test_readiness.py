"""Readiness (gateway.state.readiness) is pure: a gateway is ready only once start-up has finished,
its request pipeline built and, when it serves the API, its port listening; the admin port, which
answers /readyz, is up before both."""
from __future__ import annotations

from types import SimpleNamespace

from gateway.state import readiness


def _gw(**kw):
    membership = SimpleNamespace(ids=lambda: ["r0"], any_available=lambda: True)
    base = dict(tokenizer=object(), model=SimpleNamespace(known=True, max_model_len=4096), membership=membership,
                draining=False, pipeline=object(), api_port=True, url="http://127.0.0.1:8000")
    return SimpleNamespace(**{**base, **kw})


def test_ready_once_started():
    assert readiness(_gw()) == (True, [])


def test_not_ready_until_the_api_port_listens():
    ok, why = readiness(_gw(url=""))
    assert not ok and why == ["starting (the API port is not listening yet)"]


def test_not_ready_until_the_pipeline_is_built():
    ok, why = readiness(_gw(pipeline=None, url=""))
    assert not ok and why == ["starting (the API port is not listening yet)"]


def test_the_picker_front_needs_the_pipeline_only():
    assert readiness(_gw(api_port=False, url="")) == (True, [])
    ok, why = readiness(_gw(api_port=False, url="", pipeline=None))
    assert not ok and why == ["starting"]


def test_every_reason_is_listed():
    ok, why = readiness(_gw(tokenizer=None, draining=True, url=""))
    assert not ok and why == ["tokenizer not loaded", "draining", "starting (the API port is not listening yet)"]
