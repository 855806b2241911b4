"""Identity and bad input over real HTTP: every authentication path (API keys with rotation, JWT
HS256/RS256/JWKS and the attacks on them), model access and tenant limits, and every class of bad
request answered in OpenAI's error shape without disturbing other requests."""
from __future__ import annotations

import asyncio
import base64
import json
import time

import aiohttp
import jwt
import pytest
import pytest_asyncio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from gateway.config import config_from_dict
from gateway.server import start_gateway
from loadtests.sim.server import SimConfig, start_sim_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "warmroute-sim"
HS_SECRET = b"hs256-shared-secret-for-tests-0123456789"
ISS, AUD = "https://issuer.test", "warmroute"


def _rsa():
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return key, pem


PEM_KEY, PEM_PUB = _rsa()  # configured as rs256_public_key_file
JWKS_KEY, _ = _rsa()  # published in the JWKS file with kid "k2"
OTHER_KEY, _ = _rsa()  # nobody trusts this one


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("auth")
    import hashlib

    (d / "keys.yaml").write_text(
        "tenant-a: [old-key-a, new-key-a]\n"
        f"tenant-b: ['sha256:{hashlib.sha256(b'key-b').hexdigest()}']\n"
        "tenant-limited: [key-limited]\n"
        "tenant-narrow: [key-narrow]\n")
    (d / "hs.secret").write_bytes(HS_SECRET + b"\n")
    (d / "pub.pem").write_bytes(PEM_PUB)
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(JWKS_KEY.public_key()))
    jwk.update({"kid": "k2", "use": "sig", "alg": "RS256"})
    (d / "jwks.json").write_text(json.dumps({"keys": [jwk]}))
    (d / "salt.secret").write_text("salt-secret-http\n")
    return d


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tok, files):
    sim = await start_sim_server(SimConfig(model=MODEL, max_model_len=2048))
    cfg = config_from_dict({
        "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0, "max_body_bytes": 64 * 1024},
        "membership": {"replicas": [f"s={sim.url}"]},
        "feed": {"url": "memory://http"},
        "salt": {"secret_file": str(files / "salt.secret")},
        "auth": {
            "api_keys_file": str(files / "keys.yaml"), "api_keys_reload_s": 0.1,
            "jwt": {"hs256_secret_file": str(files / "hs.secret"), "rs256_public_key_file": str(files / "pub.pem"),
                    "jwks_file": str(files / "jwks.json"), "issuer": ISS, "audience": AUD, "tenant_claim": "org"},
            "tenants": {"tenant-limited": {"max_concurrent_reqs": 1, "max_rps": 1000},
                        "tenant-narrow": {"models": ["some-other-model"]}},
        },
    }, env={})
    g = await start_gateway(cfg, tokenizer=tok)
    async with aiohttp.ClientSession() as s:
        yield g, s, sim
    await g.close()
    await sim.close()


def _claims(**over):
    now = int(time.time())
    c = {"iss": ISS, "aud": AUD, "org": "tenant-jwt", "sub": "user-1", "iat": now, "exp": now + 300}
    c.update(over)
    return {k: v for k, v in c.items() if v is not None}


async def _post(s, url, token=None, body=None, raw=None, headers=None, path="/v1/completions", method="POST"):
    h = dict(headers or {})
    if token is not None:
        h["Authorization"] = f"Bearer {token}"
    if raw is None and body is None:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    data = raw if raw is not None else json.dumps(body).encode()
    async with s.request(method, url + path, data=data, headers=h) as r:
        text = await r.text()
        return r.status, (json.loads(text) if text.startswith("{") else text)


def _assert_error(status, body, want_status, code=None):
    assert status == want_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body


# ------------------------------------------------------------------ API keys
async def test_api_keys_valid_missing_wrong_and_rotation(env, files):
    g, s, _ = env
    for key in ("old-key-a", "new-key-a", "key-b"):  # two keys valid for tenant-a; a hashed entry for tenant-b
        st, body = await _post(s, g.url, key)
        assert st == 200, body
    st, body = await _post(s, g.url, None)
    _assert_error(st, body, 401, "missing_api_key")
    st, body = await _post(s, g.url, "wrong-key")
    _assert_error(st, body, 401, "invalid_api_key")
    st, body = await _post(s, g.url, "", headers={"Authorization": "Basic Zm9vOmJhcg=="})
    assert st == 401
    # Rotation finished: the old key is removed from the mounted file; the gateway reloads it.
    text = (files / "keys.yaml").read_text()
    (files / "keys.yaml").write_text(text.replace("[old-key-a, new-key-a]", "[new-key-a]"))
    for _ in range(50):
        await asyncio.sleep(0.1)
        st, _ = await _post(s, g.url, "old-key-a")
        if st == 401:
            break
    assert st == 401
    st, _ = await _post(s, g.url, "new-key-a")
    assert st == 200


async def test_models_route_requires_auth_and_filters(env):
    g, s, _ = env
    st, body = await _post(s, g.url, None, path="/v1/models", method="GET", raw=b"")
    assert st == 401
    st, body = await _post(s, g.url, "key-b", path="/v1/models", method="GET", raw=b"")
    assert st == 200 and [m["id"] for m in body["data"]] == [MODEL]
    st, body = await _post(s, g.url, "key-narrow", path="/v1/models", method="GET", raw=b"")
    assert st == 200 and body["data"] == []


async def test_model_not_allowed_403_and_limits_429(env):
    g, s, _ = env
    st, body = await _post(s, g.url, "key-narrow")
    _assert_error(st, body, 403, "model_not_allowed")
    # tenant-limited: one concurrent request at most; a second one meanwhile gets 429.
    slow = {"model": MODEL, "prompt": "count slowly", "max_tokens": 400, "stream": True}
    first = asyncio.create_task(_post(s, g.url, "key-limited", slow))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if g.gateway.limiter.active("tenant-limited"):
            break
    st, body = await _post(s, g.url, "key-limited")
    _assert_error(st, body, 429, "concurrency_limit_exceeded")
    st2, _ = await first
    assert st2 == 200
    st, _ = await _post(s, g.url, "key-limited")
    assert st == 200


# ------------------------------------------------------------------ JWT
async def test_jwt_valid_paths(env):
    g, s, _ = env
    hs = jwt.encode(_claims(), HS_SECRET, algorithm="HS256")
    rs = jwt.encode(_claims(), PEM_KEY, algorithm="RS256")
    jwks = jwt.encode(_claims(), JWKS_KEY, algorithm="RS256", headers={"kid": "k2"})
    for tok in (hs, rs, jwks):
        st, body = await _post(s, g.url, tok)
        assert st == 200, body


@pytest.mark.parametrize("case", [
    "expired", "wrong_audience", "wrong_issuer", "nbf_future", "alg_none", "hs256_with_public_key",
    "wrong_key", "jwks_unknown_kid", "no_tenant_claim", "no_exp", "tampered",
])
async def test_jwt_rejected(env, case):
    g, s, _ = env
    now = int(time.time())
    if case == "expired":
        tok = jwt.encode(_claims(exp=now - 10, iat=now - 100), HS_SECRET, algorithm="HS256")
    elif case == "wrong_audience":
        tok = jwt.encode(_claims(aud="someone-else"), HS_SECRET, algorithm="HS256")
    elif case == "wrong_issuer":
        tok = jwt.encode(_claims(iss="https://evil.test"), PEM_KEY, algorithm="RS256")
    elif case == "nbf_future":
        tok = jwt.encode(_claims(nbf=now + 600), HS_SECRET, algorithm="HS256")
    elif case == "alg_none":
        def b64(d):
            return base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()
        tok = f"{b64({'alg': 'none', 'typ': 'JWT'})}.{b64(_claims())}."
    elif case == "hs256_with_public_key":
        # Algorithm confusion: HMAC "signed" with the RSA public key PEM the gateway trusts.
        import hashlib
        import hmac

        def b64b(b):
            return base64.urlsafe_b64encode(b).rstrip(b"=").decode()
        head = b64b(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
        body = b64b(json.dumps(_claims()).encode())
        sig = hmac.new(PEM_PUB, f"{head}.{body}".encode(), hashlib.sha256).digest()
        tok = f"{head}.{body}.{b64b(sig)}"
    elif case == "wrong_key":
        tok = jwt.encode(_claims(), OTHER_KEY, algorithm="RS256")
    elif case == "jwks_unknown_kid":
        tok = jwt.encode(_claims(), OTHER_KEY, algorithm="RS256", headers={"kid": "nope"})
    elif case == "no_tenant_claim":
        tok = jwt.encode(_claims(org=None), HS_SECRET, algorithm="HS256")
    elif case == "no_exp":
        tok = jwt.encode(_claims(exp=None), HS_SECRET, algorithm="HS256")
    elif case == "tampered":
        good = jwt.encode(_claims(), HS_SECRET, algorithm="HS256")
        h, p, sig = good.split(".")
        evil = base64.urlsafe_b64encode(json.dumps(_claims(org="tenant-a")).encode()).rstrip(b"=").decode()
        tok = f"{h}.{evil}.{sig}"
    st, body = await _post(s, g.url, tok)
    _assert_error(st, body, 401, "invalid_token")


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("case,status,code", [
    ("malformed_json", 400, "invalid_json"),
    ("not_an_object", 400, "invalid_json"),
    ("empty_body", 400, "invalid_json"),
    ("invalid_utf8", 400, "invalid_encoding"),
    ("missing_model", 400, "missing_required_parameter"),
    ("model_wrong_type", 400, "invalid_type"),
    ("unknown_model", 404, "model_not_found"),
    ("prompt_wrong_type", 400, "invalid_type"),
    ("missing_prompt", 400, "missing_required_parameter"),
    ("token_out_of_vocab", 400, "invalid_prompt"),
    ("messages_wrong_type", 400, "invalid_type"),
    ("message_without_role", 400, "invalid_type"),
    ("stream_wrong_type", 400, "invalid_type"),
    ("max_tokens_wrong_type", 400, "invalid_type"),
    ("prompt_over_context", 400, "context_length_exceeded"),
    ("prompt_plus_max_tokens_over_context", 400, "context_length_exceeded"),
    ("body_too_large", 413, "body_too_large"),
    ("unknown_route", 404, "unknown_route"),
    ("wrong_method", 405, "method_not_allowed"),
    ("engine_rejects", 400, None),
])
async def test_bad_input_is_a_clear_4xx(env, case, status, code):
    g, s, _ = env
    path, raw, body, method = "/v1/completions", None, None, "POST"
    base = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    if case == "malformed_json":
        raw = b'{"model": "warmroute-sim", "prompt": '
    elif case == "not_an_object":
        raw = b'["a", "b"]'
    elif case == "empty_body":
        raw = b""
    elif case == "invalid_utf8":
        raw = b'{"model": "warmroute-sim", "prompt": "\xff\xfe bad"}'
    elif case == "missing_model":
        body = {"prompt": "hi"}
    elif case == "model_wrong_type":
        body = {**base, "model": 42}
    elif case == "unknown_model":
        body = {**base, "model": "gpt-9"}
    elif case == "prompt_wrong_type":
        body = {**base, "prompt": {"text": "hi"}}
    elif case == "missing_prompt":
        body = {"model": MODEL}
    elif case == "token_out_of_vocab":
        body = {**base, "prompt": [1, 2, 10**9]}
    elif case == "messages_wrong_type":
        path, body = "/v1/chat/completions", {"model": MODEL, "messages": "hello"}
    elif case == "message_without_role":
        path, body = "/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hello"}]}
    elif case == "stream_wrong_type":
        body = {**base, "stream": "yes"}
    elif case == "max_tokens_wrong_type":
        body = {**base, "max_tokens": "ten"}
    elif case == "prompt_over_context":
        body = {**base, "prompt": "word " * 3000, "max_tokens": None}
    elif case == "prompt_plus_max_tokens_over_context":
        body = {**base, "prompt": "word " * 100, "max_tokens": 2000}
    elif case == "body_too_large":
        body = {**base, "prompt": "x" * (70 * 1024)}
    elif case == "unknown_route":
        path = "/v1/embeddings"
    elif case == "wrong_method":
        method, raw = "GET", b""
    elif case == "engine_rejects":
        body = {**base, "temperature": "hot"}  # not checked by the gateway: the engine's 400 passes through
    if raw is None and body is None:
        body = base
    st, resp = await _post(s, g.url, "key-b", body=body, raw=raw, path=path, method=method)
    if case == "engine_rejects":
        assert st == 400 and "error" in resp
    else:
        _assert_error(st, resp, status, code)
    # Nothing else is affected: a good request right after still works.
    st, resp = await _post(s, g.url, "key-b")
    assert st == 200, resp
