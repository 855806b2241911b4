"""The gateway's pure cores without sockets: salt, API-key store, tenant limits, membership backoff,
in-flight accounting, the SSE relay, view assembly, and config validation with field names."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math

import pytest

from gateway.parse import parse_request

from gateway.auth import ApiKeyStore, Authenticator, TenantLimiter, TenantPolicy, parse_key_entry, tenant_hash
from gateway.config import ConfigError, config_from_dict, env_overrides
from gateway.errors import ApiError
from gateway.load import LoadTracker
from gateway.membership import Membership
from gateway.learn import usage_numbers
from gateway.proxy import SseRelay
from gateway.routing import build_views, predicted_matched_tokens
from gateway.salt import NO_AUTH_DEFAULT_SECRET, SaltDeriver, derive_salt, load_salt_secret


def test_salt_contract():
    s = derive_salt(b"k", "tenant-a")
    want = base64.urlsafe_b64encode(hmac.new(b"k", b"tenant-a", hashlib.sha256).digest()).rstrip(b"=").decode()
    assert s == want and len(s) == 43
    assert not set(s) & set("@/\\\x00=")
    assert derive_salt(b"k", "tenant-b") != s and derive_salt(b"k2", "tenant-a") != s
    d = SaltDeriver(b"k", "user")
    assert d.salt_for("tenant-a", "u1") == derive_salt(b"k", "u1")
    assert d.salt_for("tenant-a", None) == s  # no user id: the tenant is the scope
    with pytest.raises(ValueError):
        SaltDeriver(b"k", "team")
    assert NO_AUTH_DEFAULT_SECRET  # documented fixed default for --no-auth


def test_salt_secret_sources(tmp_path):
    f = tmp_path / "s"
    f.write_bytes(b"from-file\n")
    assert load_salt_secret(str(f), env={"WARMROUTE_SALT_SECRET": "env"}) == b"from-file"
    assert load_salt_secret(None, env={"WARMROUTE_SALT_SECRET": "env"}) == b"env"
    assert load_salt_secret(None, env={}) is None
    f.write_bytes(b"\n")
    with pytest.raises(ValueError):
        load_salt_secret(str(f), env={})


def test_api_key_store_and_entries():
    digest = hashlib.sha256(b"plain").digest()
    assert parse_key_entry("plain") == digest
    assert parse_key_entry("sha256:" + digest.hex()) == digest
    with pytest.raises(ValueError):
        parse_key_entry("sha256:abc")
    with pytest.raises(ValueError):
        parse_key_entry("plain", allow_plain=False)
    store = ApiKeyStore({"a": [digest, hashlib.sha256(b"other").digest()], "b": [hashlib.sha256(b"bee").digest()]})
    assert store.lookup("plain") == "a" and store.lookup("other") == "a" and store.lookup("bee") == "b"
    assert store.lookup("nope") is None
    auth = Authenticator(enabled=True, keys=store)
    assert auth.authenticate({"Authorization": "Bearer bee"}).tenant_id == "b"
    assert auth.authenticate({"x-api-key": "plain"}).tenant_id == "a"
    with pytest.raises(ApiError) as e:
        auth.authenticate({})
    assert e.value.status == 401
    with pytest.raises(ValueError):
        Authenticator(enabled=True)  # auth on with no credentials configured is a config error
    assert Authenticator(enabled=False).authenticate({}).tenant_id == "default"
    assert tenant_hash("a") == hashlib.sha256(b"a").hexdigest()[:16]


def test_tenant_limiter():
    lim = TenantLimiter({"t": TenantPolicy(max_concurrent_reqs=2, max_rps=2.0)})
    assert lim.acquire("free", now=0.0) is False  # no limits: nothing to release
    assert lim.acquire("t", now=0.0) and lim.acquire("t", now=0.0)
    with pytest.raises(ApiError) as e:
        lim.acquire("t", now=0.0)
    assert e.value.status == 429
    lim.release("t")
    lim.release("t")
    with pytest.raises(ApiError) as e:  # bucket of 2 used up at t=0
        lim.acquire("t", now=0.1)
    assert e.value.code == "rate_limit_exceeded" and "Retry-After" in e.value.headers
    assert lim.acquire("t", now=1.0)
    assert lim.acquire("t", now=2.0)  # both slots held
    # asking after a stored response takes no slot (nothing to release), within the request rate
    assert lim.acquire("t", now=5.0, slot=False) is False and lim.acquire("t", now=5.0, slot=False) is False
    with pytest.raises(ApiError) as e:
        lim.acquire("t", now=5.0, slot=False)
    assert e.value.code == "rate_limit_exceeded"


def test_tenant_limiter_counts_each_sequence_the_engine_runs():
    """A completions batch or `n` > 1 takes a slot per engine sequence (widen), at most the whole
    limit: n cannot multiply a tenant's share, and a request larger than the limit runs alone."""
    lim = TenantLimiter({"t": TenantPolicy(max_concurrent_reqs=4)})
    assert lim.acquire("t") and lim.widen("t", 2) == 2 and lim.active("t") == 3  # n = 3
    assert lim.acquire("t") and lim.widen("t", 0) == 0 and lim.active("t") == 4  # a plain request fills it
    with pytest.raises(ApiError) as e:
        lim.acquire("t")
    assert e.value.status == 429 and e.value.code == "concurrency_limit_exceeded"
    lim.release("t", 1)  # the plain one ends
    assert lim.acquire("t")
    with pytest.raises(ApiError) as e:  # n = 2 beside the n = 3: five sequences over four
        lim.widen("t", 1)
    assert e.value.code == "concurrency_limit_exceeded" and "2 sequences" in e.value.message
    lim.release("t", 1)
    lim.release("t", 3)
    assert lim.active("t") == 0
    assert lim.acquire("t") and lim.widen("t", 15) == 3 and lim.active("t") == 4  # n = 16 alone: the whole limit
    with pytest.raises(ApiError):
        lim.acquire("t")
    lim.release("t", 4)
    assert lim.acquire("t")
    with pytest.raises(ApiError):  # n = 16 beside anything: refused
        lim.acquire("t") and lim.widen("t", 15)
    other = TenantLimiter({"t": TenantPolicy(max_concurrent_reqs=4)})  # the other gateways' count too
    other.others_active = {"t": 2}
    assert other.acquire("t") and other.widen("t", 1) == 1
    with pytest.raises(ApiError):
        other.acquire("t")
    assert TenantLimiter({"u": TenantPolicy(max_rps=5.0)}).widen("u", 7) == 0  # rate only: no slots


def test_membership_backoff_and_changes():
    now = [100.0]
    m = Membership(eject_base_s=1.0, eject_max_s=5.0, clock=lambda: now[0])
    added, removed = m.set_members({"a": "http://a/", "b": "http://b"})
    assert added == ["a", "b"] and removed == [] and m.get("a").url == "http://a"
    assert m.available("a")
    assert m.report_failure("a", "connection refused") == 1.0
    assert not m.available("a")
    now[0] += 1.01
    assert m.available("a")
    assert m.report_failure("a", "x") == 2.0 and m.report_failure("a", "x") == 4.0 and m.report_failure("a", "x") == 5.0
    m.report_success("a")
    assert m.get("a").failures == 0
    m.probe_result("b", False, "down")
    assert not m.available("b") and m.any_available() is False
    m.probe_result("b", True)
    assert m.available("b")
    added, removed = m.set_members({"b": "http://b", "c": "http://c"})
    assert added == ["c"] and removed == ["a"]


def test_load_tracker_inflight_and_shared():
    lt = LoadTracker()
    f1 = lt.dispatch("r", 100)
    f2 = lt.dispatch("r", 50)
    ld = lt.get("r")
    assert (ld.inflight_reqs, ld.inflight_tokens, ld.active_reqs) == (2, 150, 0)
    f1.first_token()
    f1.first_token()  # idempotent
    assert (lt.get("r").inflight_reqs, lt.get("r").inflight_tokens, lt.get("r").active_reqs) == (1, 50, 1)
    pending = lt.take_pending()
    assert pending == {"r": (1, 50, 2)}  # +2/+150 then -1/-100; both still open (one in flight, one active)
    # The feed's shared counters include ours (1, 50, 2) plus another gateway's (3, 300, 4): one
    # of its requests is past its first token, still holding a slot.
    lt.set_shared({"r": (4, 350, 6)})
    assert (lt.get("r").others_reqs, lt.get("r").others_tokens, lt.get("r").others_open) == (3, 300, 4)
    # a gateway of the version before the open counter adds none: its in-flight ones are open at least
    lt.set_shared({"r": (4, 350, 2)})
    assert lt.get("r").others_open == 3
    f2.finish()
    f1.finish()
    assert (lt.get("r").inflight_reqs, lt.get("r").active_reqs) == (0, 0)
    assert lt.take_pending() == {"r": (-1, -50, -2)}  # the in-flight one's three counts, the active one's open


def test_a_request_counts_the_sequences_the_engine_runs_for_it():
    """A completions batch of 3 prompts with n = 4 is 12 engine requests: counted as 12 in flight,
    then active, in the shared counts too, whoever owns the flight (a background hold); its
    tokens and routed rate stay one request's."""
    assert parse_request("completions", {"prompt": ["a", "b", "c"], "n": 4}, "m").sequences == 12
    assert parse_request("chat", {"messages": [{"role": "user"}]}, "m").sequences == 1
    lt = LoadTracker()
    f = lt.dispatch("r", 100, now=0.0, seqs=12)
    assert (lt.get("r").inflight_reqs, lt.get("r").inflight_tokens) == (12, 100)
    assert lt.take_pending() == {"r": (12, 100, 12)}  # what the other gateways are told
    assert lt.get("r").routed_rps == pytest.approx(1.0 / lt.routed_tau_s)
    f.first_token()
    assert (lt.get("r").inflight_reqs, lt.get("r").active_reqs) == (0, 12)
    kept = f.handed_over()
    f.finish()
    assert lt.get("r").active_reqs == 12
    kept.finish()
    assert lt.get("r").active_reqs == 0 and lt.take_pending() == {"r": (-12, -100, -12)}


def test_mean_uncached_tokens_weighs_requests_by_age():
    """With the time given (the gateway's dispatch always gives it), each request's weight in the
    mean uncached tokens falls by e per SIZE_TAU_S: right after a miss the mean carries it, and
    the first request after a lull outweighs it (by count, one request would move it 10%)."""
    from gateway.load import SIZE_TAU_S

    lt = LoadTracker()
    for i in range(10):
        lt.dispatch("r", 100, now=i * 0.1)
    assert lt.get("r").mean_uncached_tokens == pytest.approx(100.0)
    lt.dispatch("r", 3000, now=1.0)  # a miss: ten requests of weight ~0.9 each against 1
    after_miss = lt.get("r").mean_uncached_tokens
    assert 300.0 < after_miss < 500.0
    # after a lull of 4 x SIZE_TAU_S the eleven earlier requests together weigh ~0.2 against this
    # one: under a quarter of the miss's excess is left (by count, 90% would be)
    lt.dispatch("r", 100, now=1.0 + 4 * SIZE_TAU_S)
    assert lt.get("r").mean_uncached_tokens < 100.0 + 0.25 * (after_miss - 100.0)
    by_count = LoadTracker()  # no time given: a moving mean by count, as before
    for n in (100, 100, 3000, 100):
        by_count.dispatch("r", n)
    assert by_count.get("r").mean_uncached_tokens == pytest.approx((100 + 0.1 * 2900) * 0.9 + 10)


def test_dispatch_gauges_give_every_gateways_rates_and_sizes():
    """Each gateway publishes its routed rate and by-age size mean per replica with the exchange;
    the sums it reads back include its own, which it takes out: its views then carry what all the
    gateways sent (a process seeing a quarter of the requests no longer judges on its quarter)."""
    from gateway.load import SIZE_TAU_S

    lt = LoadTracker(routed_tau_s=10.0)
    for i in range(4):
        lt.dispatch("r", 100, now=i * 0.5)
    g = lt.gauges(2.0)
    rate, w, wt = g["r"]
    assert rate == pytest.approx(lt.routed_rps("r", 2.0)) and wt == pytest.approx(100.0 * w) and 3.0 < w < 4.0
    assert lt.pool_routed_rps("r", 2.0) == pytest.approx(rate)  # nothing from the others yet
    # the feed's sums: ours plus another gateway's 0.9 requests/s of 3,000-token misses (weight 2)
    lt.set_shared({"r": (0, 0, 0, rate + 0.9, w + 2.0, wt + 2.0 * 3000.0)})
    ld = lt.get("r")
    assert (ld.others_rps, ld.others_size_weight, ld.others_size_tokens) == pytest.approx((0.9, 2.0, 6000.0))
    assert lt.pool_routed_rps("r", 2.0) == pytest.approx(rate + 0.9)
    assert lt.pool_mean_uncached("r", 2.0) == pytest.approx((w * 100.0 + 6000.0) / (w + 2.0))
    (v,) = build_views(["r"], matches={}, available={"r": True}, live={"r": True}, reports={}, loads={"r": ld},
                       rates={"r": (1e-3, 0.015)}, routed_rps={"r": lt.pool_routed_rps("r", 2.0)})
    assert v.routed_rps == pytest.approx(rate + 0.9) and v.others_routed_rps == pytest.approx(0.9)  # the others' part
    # ours keep aging between exchanges; theirs stay as they were read
    later = lt.pool_mean_uncached("r", 2.0 + SIZE_TAU_S)
    assert later == pytest.approx((w / math.e * 100.0 + 6000.0) / (w / math.e + 2.0))
    # a three-field exchange (no gauges: one gateway, or a feed of the earlier version) keeps ours alone
    lt.set_shared({"r": (0, 0, 0)})
    assert lt.pool_routed_rps("r", 2.0) == pytest.approx(rate) and lt.pool_mean_uncached("r", 2.0) == pytest.approx(100.0)
    assert LoadTracker().pool_mean_uncached("r", 0.0) == -1.0  # nothing known


def _ev(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_sse_relay_strips_usage_unless_asked_and_handles_split_events():
    usage = {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}}
    stream = (_ev({"choices": [{"delta": {"content": "a"}}]}) + _ev({"choices": [{"delta": {"content": "b"}}]})
              + _ev({"choices": [], "usage": usage}) + b"data: [DONE]\n\n")
    for wants in (False, True):
        t = [0.0]

        def clock():
            t[0] += 1.0
            return t[0]
        r = SseRelay(wants, clock=clock)
        out = b""
        for i in range(0, len(stream), 7):  # events split across chunks at arbitrary points
            out += r.feed(stream[i:i + 7])
        out += r.tail()
        assert r.done and r.usage == usage and r.content_events == 2
        assert (b'"usage"' in out) is wants
        assert out.endswith(b"data: [DONE]\n\n") and out.count(b"\n\n") == (4 if wants else 3)
    assert usage_numbers(usage) == (40, 2, 32)
    assert usage_numbers(None) == (None, None, None)


def test_build_views_and_prediction():
    from gateway.index import Match
    from gateway.load import ReplicaLoad
    from policies.base import RequestView
    from replica_agent.feed.records import LoadReport

    rep = LoadReport(3, 2, 0.5, 0, 0, 0, 16, 0.0)
    views = build_views(
        ["a", "b"], matches={"a": Match(4, 6)}, available={"a": True, "b": False}, live={"a": True},
        reports={"a": rep}, loads={"a": ReplicaLoad(1, 100, 0, 2, 50, 80.0), "b": ReplicaLoad(0, 0, 5)},
        rates={"a": (1e-4, 0.01), "b": (5e-5, 0.02)})
    a, b = views
    assert (a.matched_blocks_gpu, a.matched_blocks_cpu, a.running_reqs, a.waiting_reqs) == (4, 6, 3, 2)
    assert (a.inflight_reqs, a.inflight_prefill_tokens, a.kv_usage) == (3, 150, 0.5)
    assert a.mean_uncached_prefill_tokens == 80.0 and a.prefill_s_per_token == 1e-4
    assert not b.healthy and b.running_reqs == 5 and b.matched_blocks_gpu == 0 and not b.index_live
    rv = RequestView(prompt_tokens=97, block_size=16)
    assert predicted_matched_tokens(rv, a) == 6 * 16
    assert predicted_matched_tokens(RequestView(prompt_tokens=64, block_size=16), a) == 3 * 16  # last token recomputed


def test_config_errors_name_the_field_and_env_overrides():
    env = {"WARMROUTE_PROXY__MAX_ATTEMPTS": "3", "WARMROUTE_POLICY__PARAMS__W_QUEUE": "2.5",
           "WARMROUTE_SALT_SECRET": "not-config"}
    assert env_overrides(env) == {"proxy": {"max_attempts": 3}, "policy": {"params": {"w_queue": 2.5}}}
    cfg = config_from_dict({"membership": {"replicas": {"a": "http://h:1"}}}, env=env)
    assert cfg.proxy.max_attempts == 3 and cfg.policy.params == {"w_queue": 2.5}
    assert cfg.membership.replicas[0].id == "a"
    bad = [
        ({"server": {"port": 70000}}, "server.port"),
        ({"server": {"workers": 0}}, "server.workers"),
        ({"proxy": {"connect_timeout_s": 0}}, "proxy.connect_timeout_s"),
        ({"proxy": {"unknown": 1}}, "proxy.unknown"),
        ({"policy": {"name": "nope"}}, "policy.name"),
        ({"membership": {"replicas": [{"id": "a", "url": "ftp://x"}]}}, "membership.replicas[0].url"),
        ({"membership": {"replicas": ["a=http://x", "a=http://y"]}}, "membership.replicas[1].id"),
        ({"auth": {"api_keys": {"t": ["plain-key"]}}}, "auth.api_keys.t[0]"),
        ({"salt": {"scope": "team"}}, "salt.scope"),
        ({"feed": {"url": "kafka://x"}}, "feed.url"),
        ({"model": {"block_size": "big"}}, "model.block_size"),
    ]
    for data, field in bad:
        with pytest.raises(ConfigError) as e:
            config_from_dict(data, env={})
        assert str(e.value).startswith(field), (field, str(e.value))


def test_a_replica_that_answered_within_the_probe_interval_is_not_probed():
    """An answer is the evidence a probe would fetch: no probe while the last passed and the
    replica answered a request within the interval; a replica not yet probed, down, or quiet for
    the interval is probed; an answer resets the count of slow probes."""
    from gateway.membership import Membership

    now = [100.0]
    m = Membership(clock=lambda: now[0])
    m.set_members({"a": "http://a", "b": "http://b"})
    a = m.get("a")
    m.report_success("a")
    assert a.needs_probe(2.0, now[0])  # never probed: its verdict is unknown
    m.probe_result("a", True)
    m.report_success("a")
    assert not a.needs_probe(2.0, now[0])
    now[0] = 101.9
    assert not a.needs_probe(2.0, now[0])
    now[0] = 102.0
    assert a.needs_probe(2.0, now[0])  # quiet for a whole interval
    m.report_success("a")
    m.probe_result("a", False, "health probe status 503")
    assert a.needs_probe(2.0, now[0])  # down: only a probe brings it back
    m.probe_result("b", True)
    assert m.get("b").needs_probe(2.0, now[0])  # probed, never served
    m.probe_result("b", False, "timed out", timed_out=True)
    m.probe_result("b", False, "timed out", timed_out=True)
    m.report_success("b")  # an answer between slow probes: the engine is busy, not down
    m.probe_result("b", False, "timed out", timed_out=True)
    assert m.available("b")  # one timeout since the answer, not three


async def test_the_prober_skips_replicas_that_answered_since_its_last_round():
    """Against a real HTTP server: one round probes both replicas; after one of them answered a
    request, the next round probes only the other."""
    from aiohttp import web
    import aiohttp

    from gateway.membership import Membership, MembershipRunner

    hits: list[str] = []

    async def health(request):
        hits.append(request.match_info["rid"])
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/{rid}/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        m = Membership()
        m.set_members({r: f"http://127.0.0.1:{port}/{r}" for r in ("a", "b")})
        async with aiohttp.ClientSession() as session:
            mr = MembershipRunner(m, session, health_path="/health", health_interval_s=30.0, health_timeout_s=2.0)
            await mr.probe_all()
            assert sorted(hits) == ["a", "b"] and m.get("a").probe_ok and m.get("b").probe_ok
            m.report_success("a")
            await mr.probe_all()
            assert sorted(hits) == ["a", "b", "b"]
    finally:
        await runner.cleanup()


def test_slow_health_probes_need_several_timeouts_but_refusals_count_at_once():
    """A busy engine answers /health late: three timeouts in a row before it counts as down; a
    refused connection or a non-200 answer marks it down at once; one success resets the count."""
    from gateway.membership import Membership

    m = Membership(probe_timeouts_to_down=3)
    m.set_members({"a": "http://a", "b": "http://b"})
    for _ in range(2):
        m.probe_result("a", False, "timed out", timed_out=True)
    assert m.available("a")
    m.probe_result("a", True)
    for _ in range(2):
        m.probe_result("a", False, "timed out", timed_out=True)
    assert m.available("a")  # the success reset the count
    m.probe_result("a", False, "timed out", timed_out=True)
    assert not m.available("a")
    m.probe_result("b", False, "health probe status 503")
    assert not m.available("b")
    m.probe_result("b", True)
    assert m.available("b")
