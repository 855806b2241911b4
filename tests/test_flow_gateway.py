"""Flow control through a real gateway over HTTP, against replicas whose answers the test
releases one by one (so "saturated" is exact): held requests come out in fair order (tenants by
weight from the keys file and from a JWT claim, classes within a tenant, the priority header's
rules), are re-decided at release, and are refused with clear answers (429 queue_full and
queue_timeout with Retry-After, 503 when no replica is healthy, 503 at shutdown); a client that
disconnects leaves the queue at once; an unsaturated pool lets everything straight through;
switched off, nothing is held; metrics and decision-span attributes say what happened."""
from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest

from gateway.auth import tenant_hash
from gateway.config import config_from_dict
from gateway.server import start_gateway
from tests.flow_helpers import HeldReplica, ask, flow_config, token_for, until

TENANTS = {
    "filler": "k-filler",
    "quiet": "k-quiet",
    "noisy": "k-noisy",
    "heavy": ("k-heavy", {"weight": 3}),
    "light": "k-light",
    "vip": ("k-vip", {"allowed_priorities": ["interactive"]}),
}


async def _gateway(tmp_path, tok, replicas: dict, flow: dict | None = None, tracer_provider=None, **sections):
    cfg = config_from_dict(flow_config(tmp_path, replicas, TENANTS, flow, **sections), env={})
    return await start_gateway(cfg, tokenizer=tok, tracer_provider=tracer_provider)


async def _fill(s, g, rep: HeldReplica, n: int = 2) -> list[asyncio.Task]:
    """Occupy the replica's `n` slots with the filler tenant's requests (their streams stay open)."""
    tasks = [asyncio.create_task(ask(s, g.url, "k-filler", f"fill{i}")) for i in range(n)]
    await until(lambda: rep.open_count() == n, what="the slots to fill")
    return tasks


async def _release_one_by_one(rep: HeldReplica, g, count: int) -> None:
    """Free a slot, wait for the next held request to reach the replica, `count` times."""
    for _ in range(count):
        n = len(rep.arrived)
        rep.release(1)
        await until(lambda: len(rep.arrived) > n, what=f"a held request to be released ({rep.arrived}, held {len(g.gateway.flow.queue)}, load {g.gateway.routing.load.get('r0')})")


def _metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _metrics(s, g) -> str:
    async with s.get(g.admin_url + "/metrics") as r:
        return await r.text()


async def test_held_requests_come_out_fairly_between_tenants(tmp_path, tok):
    rep = await HeldReplica().start()
    g = await _gateway(tmp_path, tok, {"r0": rep.url})
    try:
        async with aiohttp.ClientSession() as s:
            fill = await _fill(s, g, rep)
            noisy = [asyncio.create_task(ask(s, g.url, "k-noisy", f"n{i}")) for i in range(6)]
            await until(lambda: len(g.gateway.flow.queue) == 6, what="noisy to be held")
            quiet = [asyncio.create_task(ask(s, g.url, "k-quiet", f"q{i}")) for i in range(2)]
            await until(lambda: len(g.gateway.flow.queue) == 8, what="quiet to be held")
            assert rep.arrived == ["fill0", "fill1"] or sorted(rep.arrived) == ["fill0", "fill1"]
            await _release_one_by_one(rep, g, 8)
            order = rep.arrived[2:]
            # without flow control the engine would see n0..n5 then q0, q1; fair: alternating
            assert sorted(order[:4]) == ["n0", "n1", "q0", "q1"], order
            assert [x for x in order if x[0] == "n"] == [f"n{i}" for i in range(6)]  # FIFO within the tenant
            rep.drain()
            results = await asyncio.gather(*fill, *noisy, *quiet)
            assert all(st == 200 for st, _, _ in results)
            text = await _metrics(s, g)
            assert _metric(text, "warmroute_gateway_flow_admissions_total", tenant_hash=tenant_hash("noisy"),
                           path="released") == 6
            assert _metric(text, "warmroute_gateway_flow_admissions_total", tenant_hash=tenant_hash("filler"),
                           path="direct") == 2
            assert _metric(text, "warmroute_gateway_flow_queued_requests", tenant_hash=tenant_hash("noisy")) == 0
            assert _metric(text, "warmroute_gateway_flow_queue_wait_seconds_count", tenant_hash=tenant_hash("quiet"),
                           priority="standard") == 2
    finally:
        await g.close()
        await rep.close()


async def test_a_request_counts_the_sequences_it_makes_in_the_fair_order_and_the_tenant_limit(tmp_path, tok):
    """`n` = 2 is two engine sequences: it costs its tenant two of its share, so a tenant asking
    n = 1 gets two releases per n = 2 one (counted as requests they would alternate), and it takes
    two of its tenant's `max_concurrent_reqs`, at most the whole limit (a larger request runs alone)."""
    rep = await HeldReplica().start()
    g = await _gateway(tmp_path, tok, {"r0": rep.url}, auth={"tenants": {"light": {"max_concurrent_reqs": 3}}})
    try:
        async with aiohttp.ClientSession() as s:
            fill = await _fill(s, g, rep)
            noisy = [asyncio.create_task(ask(s, g.url, "k-noisy", f"n{i}", n=2)) for i in range(4)]
            await until(lambda: len(g.gateway.flow.queue) == 4, what="noisy to be held")
            quiet = [asyncio.create_task(ask(s, g.url, "k-quiet", f"q{i}")) for i in range(4)]
            await until(lambda: len(g.gateway.flow.queue) == 8, what="quiet to be held")
            while len(g.gateway.flow.queue):  # free every open slot; the next ones come out in fair order
                k = len(rep.arrived)
                rep.release(rep.open_count())
                await until(lambda: len(rep.arrived) > k, what=f"a release ({rep.arrived})")
            await until(lambda: len(rep.arrived) == 10, what="the last released to arrive")
            order = rep.arrived[2:]
            assert sum(x[0] == "q" for x in order[:6]) == 4, order  # by requests: 3
            assert [x for x in order if x[0] == "n"] == [f"n{i}" for i in range(4)], order
            rep.drain()
            assert all(st == 200 for st, _, _ in await asyncio.gather(*fill, *noisy, *quiet))
            rep.hold_again()
            # the tenant limit: 3 slots; n = 2 holds two of them
            first = asyncio.create_task(ask(s, g.url, "k-light", "a", n=2))
            await until(lambda: g.gateway.limiter.active("light") == 2, what="n = 2 to take two slots")
            st, _, body = await ask(s, g.url, "k-light", "b", n=2)
            assert st == 429 and json.loads(body)["error"]["code"] == "concurrency_limit_exceeded", body
            second = asyncio.create_task(ask(s, g.url, "k-light", "c"))
            await until(lambda: g.gateway.limiter.active("light") == 3, what="the third slot")
            st, _, _ = await ask(s, g.url, "k-light", "d")
            assert st == 429
            rep.drain()
            assert [r[0] for r in await asyncio.gather(first, second)] == [200, 200]
            await until(lambda: g.gateway.limiter.active("light") == 0, what="the slots back")
            rep.hold_again()
            big = asyncio.create_task(ask(s, g.url, "k-light", "e", n=8))  # over the limit: alone, with all of it
            await until(lambda: g.gateway.limiter.active("light") == 3, what="n = 8 to take the whole limit")
            st, _, _ = await ask(s, g.url, "k-light", "f")
            assert st == 429
            rep.drain()
            assert (await big)[0] == 200
            await until(lambda: g.gateway.limiter.active("light") == 0, what="the slots back")
    finally:
        await g.close()
        await rep.close()


async def test_weights_from_the_keys_file_and_from_a_jwt_claim(tmp_path, tok):
    rep = await HeldReplica().start()
    g = await _gateway(tmp_path, tok, {"r0": rep.url})
    try:
        async with aiohttp.ClientSession() as s:
            fill = await _fill(s, g, rep)
            tasks = [asyncio.create_task(ask(s, g.url, "k-light", f"l{i}")) for i in range(8)]
            await until(lambda: len(g.gateway.flow.queue) == 8)
            tasks += [asyncio.create_task(ask(s, g.url, "k-heavy", f"h{i}")) for i in range(8)]
            await until(lambda: len(g.gateway.flow.queue) == 16)
            await _release_one_by_one(rep, g, 12)
            first = rep.arrived[2:14]
            assert 8 <= sum(x.startswith("h") for x in first) <= 10, first  # weight 3 against 1: 9, within a request
            # a JWT's weight claim: tenant "jwt-big" weighs 3 against light's 1
            rep.drain()
            await asyncio.gather(*fill, *tasks)
            rep.hold_again()
            fill = await _fill(s, g, rep)
            big = token_for("jwt-big", warmroute_weight=3)
            tasks = [asyncio.create_task(ask(s, g.url, "k-light", f"l{i}")) for i in range(8)]
            await until(lambda: len(g.gateway.flow.queue) == 8)
            tasks += [asyncio.create_task(ask(s, g.url, big, f"j{i}")) for i in range(8)]
            await until(lambda: len(g.gateway.flow.queue) == 16)
            await _release_one_by_one(rep, g, 12)
            first = rep.arrived[2:14]
            assert 8 <= sum(x.startswith("j") for x in first) <= 10, first
            rep.drain()
            assert all(st == 200 for st, _, _ in await asyncio.gather(*fill, *tasks))
    finally:
        await g.close()
        await rep.close()


async def test_priority_classes_within_a_tenant_and_the_headers_rules(tmp_path, tok):
    rep = await HeldReplica().start()
    g = await _gateway(tmp_path, tok, {"r0": rep.url})
    h = "X-Warmroute-Priority"
    try:
        async with aiohttp.ClientSession() as s:
            fill = await _fill(s, g, rep)
            tasks = [asyncio.create_task(ask(s, g.url, "k-vip", f"b{i}", {h: "batch"})) for i in range(3)]
            tasks.append(asyncio.create_task(ask(s, g.url, "k-vip", "s0")))
            await until(lambda: len(g.gateway.flow.queue) == 4)
            tasks.append(asyncio.create_task(ask(s, g.url, "k-vip", "i0", {h: "interactive"})))
            await until(lambda: len(g.gateway.flow.queue) == 5)
            status, _, body = await ask(s, g.url, "k-quiet", "x", {h: "interactive"})  # not allowed
            err = json.loads(body)["error"]
            assert status == 403 and err["code"] == "priority_not_allowed" and err["param"] == h
            status, _, body = await ask(s, g.url, "k-quiet", "x", {h: "urgent"})  # no such class
            assert status == 400 and json.loads(body)["error"]["code"] == "invalid_priority"
            await _release_one_by_one(rep, g, 5)
            assert rep.arrived[2:] == ["i0", "s0", "b0", "b1", "b2"]
            rep.drain()
            assert all(st == 200 for st, _, _ in await asyncio.gather(*fill, *tasks))
    finally:
        await g.close()
        await rep.close()


async def test_bounds_answer_429_with_retry_after_in_openais_shape(tmp_path, tok):
    rep = await HeldReplica().start()
    g = await _gateway(tmp_path, tok, {"r0": rep.url}, {"max_queue_reqs_per_tenant": 2, "max_queue_wait_s": 0.6})
    try:
        async with aiohttp.ClientSession() as s:
            fill = await _fill(s, g, rep)
            held = [asyncio.create_task(ask(s, g.url, "k-noisy", f"n{i}")) for i in range(2)]
            await until(lambda: len(g.gateway.flow.queue) == 2)
            status, headers, body = await ask(s, g.url, "k-noisy", "n2")
            err = json.loads(body)["error"]
            assert status == 429 and err["code"] == "queue_full" and err["type"] == "rate_limit_error"
            assert set(err) == {"message", "type", "param", "code"} and int(headers["Retry-After"]) >= 1
            quiet = asyncio.create_task(ask(s, g.url, "k-quiet", "q0"))  # another tenant still gets in line
            await until(lambda: len(g.gateway.flow.queue) == 3)
            t0 = asyncio.get_running_loop().time()
            results = await asyncio.gather(*held, quiet)
            waited = asyncio.get_running_loop().time() - t0
            for status, headers, body in results:
                err = json.loads(body)["error"]
                assert status == 429 and err["code"] == "queue_timeout" and int(headers["Retry-After"]) >= 1
            assert 0.3 < waited < 3.0
            assert rep.arrived == ["fill0", "fill1"] or sorted(rep.arrived) == ["fill0", "fill1"]
            text = await _metrics(s, g)
            assert _metric(text, "warmroute_gateway_flow_sheds_total", tenant_hash=tenant_hash("noisy"), reason="queue_full") == 1
            assert _metric(text, "warmroute_gateway_flow_sheds_total", tenant_hash=tenant_hash("noisy"), reason="queue_timeout") == 2
            rep.drain()
            await asyncio.gather(*fill)
    finally:
        await g.close()
        await rep.close()


async def test_a_client_that_disconnects_leaves_the_queue_at_once(tmp_path, tok):
    rep = await HeldReplica().start()
    g = await _gateway(tmp_path, tok, {"r0": rep.url})
    try:
        async with aiohttp.ClientSession() as s:
            fill = await _fill(s, g, rep)
            stays = asyncio.create_task(ask(s, g.url, "k-quiet", "stays"))
            await until(lambda: len(g.gateway.flow.queue) == 1)
            async with aiohttp.ClientSession() as other:
                leaves = asyncio.create_task(ask(other, g.url, "k-noisy", "leaves"))
                await until(lambda: len(g.gateway.flow.queue) == 2)
                leaves.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await leaves
            await until(lambda: len(g.gateway.flow.queue) == 1, timeout_s=2.0, what="the client to leave the queue")
            text = await _metrics(s, g)
            assert _metric(text, "warmroute_gateway_flow_sheds_total", tenant_hash=tenant_hash("noisy"), reason="client_gone") == 1
            rep.drain()
            assert (await stays)[0] == 200
            await asyncio.gather(*fill)
            assert "leaves" not in rep.arrived
    finally:
        await g.close()
        await rep.close()


async def test_held_requests_get_503_when_no_replica_is_healthy_and_at_shutdown(tmp_path, tok):
    rep = await HeldReplica().start()
    g = await _gateway(tmp_path, tok, {"r0": rep.url})
    try:
        async with aiohttp.ClientSession() as s:
            fill = await _fill(s, g, rep)
            held = [asyncio.create_task(ask(s, g.url, "k-noisy", f"n{i}")) for i in range(2)]
            await until(lambda: len(g.gateway.flow.queue) == 2)
            rep.health = 503
            for status, headers, body in await asyncio.gather(*held):
                assert status == 503 and json.loads(body)["error"]["code"] == "no_replica_available" and headers["Retry-After"]
            rep.health = 200
            await until(lambda: g.gateway.membership.any_available(), what="the replica back")
            held = [asyncio.create_task(ask(s, g.url, "k-noisy", f"m{i}")) for i in range(2)]
            await until(lambda: len(g.gateway.flow.queue) == 2)
            closing = asyncio.create_task(g.close())
            for status, _, body in await asyncio.gather(*held):
                assert status == 503 and json.loads(body)["error"]["code"] == "shutting_down"
            rep.drain()
            await asyncio.gather(*fill)
            await closing
    finally:
        await g.close()
        await rep.close()


def _spy_on_policy(g) -> tuple[list, list]:
    """Record the pipeline policy's rank() and placed() calls as (request id, winner)."""
    pol = g.gateway.pipeline.policy
    ranked, placed = [], []
    rank, place = pol.rank, pol.placed

    def spy_rank(request, replicas, rng):
        d = rank(request, replicas, rng)
        ranked.append((request.request_id, d.winner))
        return d

    def spy_placed(request, decision):
        placed.append((request.request_id, decision.winner))
        place(request, decision)

    pol.rank, pol.placed = spy_rank, spy_placed
    return ranked, placed


async def test_a_held_request_is_placed_by_a_decision_made_at_release(tmp_path, tok):
    """Two replicas, one slot each, both busy; the held request was ranked first for one of them.
    That one is ejected while it waits, then both slots free: the request goes to the other, which
    only a decision at release time knows is the right one."""
    r0, r1 = await HeldReplica().start(), await HeldReplica().start()
    g = await _gateway(tmp_path, tok, {"r0": r0.url, "r1": r1.url}, {"max_num_seqs": 1})
    ranked, placed = _spy_on_policy(g)
    try:
        async with aiohttp.ClientSession() as s:
            fill = [asyncio.create_task(ask(s, g.url, "k-filler", f"fill{i}")) for i in range(2)]
            await until(lambda: r0.open_count() == 1 and r1.open_count() == 1)
            held = asyncio.create_task(ask(s, g.url, "k-quiet", "late"))
            await until(lambda: len(g.gateway.flow.queue) == 1)
            entry = next(iter(g.gateway.flow.queue.entries()))
            first = entry.payload.ctx.routing.decision.winner
            g.gateway.membership.report_failure(first, "test")
            (r0 if first == "r0" else r1).release(1)
            (r1 if first == "r0" else r0).release(1)
            await until(lambda: "late" in r0.arrived + r1.arrived)
            assert "late" in (r1 if first == "r0" else r0).arrived
            r0.drain(), r1.drain()
            status, headers, _ = await held
            assert status == 200 and headers["X-Warmroute-Replica"] != first
            # the policy ranked the held request twice (arrival, release) and recorded it once, where it went
            assert len(ranked) == 4 and ranked[2] == (ranked[3][0], first) and {w for _, w in placed[:2]} == {"r0", "r1"}
            assert len(placed) == 3 and placed[2] == (ranked[3][0], headers["X-Warmroute-Replica"])
            r0.drain(), r1.drain()
            await asyncio.gather(*fill)
    finally:
        await g.close()
        await r0.close()
        await r1.close()


async def test_a_request_takes_a_free_slot_elsewhere_when_it_loses_no_cache_there(tmp_path, tok):
    """Two replicas, one slot each; prefix_hash sends a prompt to the same replica every time.
    With that replica's slot taken and the other's free, the pool has room and the repeat goes on
    at once. The gateway here routes by load only (no feed), so it knows of no cached prefix the
    free replica would lose: the request takes the free slot (the rule that keeps a request on a
    holder that matches more is in tests/test_flow_admission.py)."""
    r0, r1 = await HeldReplica().start(), await HeldReplica().start()
    g = await _gateway(tmp_path, tok, {"r0": r0.url, "r1": r1.url}, {"max_num_seqs": 1}, policy={"name": "prefix_hash"})
    doc = "one shared document, long enough for several blocks. " * 20
    try:
        async with aiohttp.ClientSession() as s:
            first = asyncio.create_task(ask(s, g.url, "k-filler", doc))
            await until(lambda: r0.open_count() + r1.open_count() == 1)
            home, other = (r0, r1) if r0.open_count() else (r1, r0)
            second = asyncio.create_task(ask(s, g.url, "k-filler", doc))
            await until(lambda: len(other.arrived) == 1, what="the repeat to take the free slot")
            assert len(g.gateway.flow.queue) == 0 and len(home.arrived) == 1
            r0.drain(), r1.drain()
            assert [st for st, _, _ in await asyncio.gather(first, second)] == [200, 200]
            text = await _metrics(s, g)
            assert _metric(text, "warmroute_gateway_flow_admissions_total", tenant_hash=tenant_hash("filler"), path="direct") == 2
    finally:
        await g.close()
        await r0.close()
        await r1.close()


async def _quiet_once(s, g, rep) -> None:
    """The quiet tenant's first request, answered: its prompt is on the replica, the tenant recent."""
    q0 = asyncio.create_task(ask(s, g.url, "k-quiet", "q0"))
    await until(lambda: rep.open_count() == 1, what="the quiet request")
    rep.release(1)
    assert (await q0)[0] == 200


@pytest.mark.parametrize("headroom", [1, 0])
async def test_a_light_tenant_finds_the_headroom_a_heavy_one_leaves(tmp_path, tok, headroom):
    """One replica, 3 slots, two tenants of equal weight (fair share 1.5 slots each), headroom 1:
    while the quiet tenant (under its share) is recent, the noisy one, once over its share, gets 2
    slots and the rest of its requests wait; the quiet tenant's next request goes straight on into
    the third. Once the quiet tenant has been idle for HEADROOM_RECENT_S the noisy one fills every
    slot. With headroom 0 the quiet request waits for a slot to free."""
    rep = await HeldReplica().start()
    g = await _gateway(tmp_path, tok, {"r0": rep.url}, {"max_num_seqs": 3, "headroom_reqs": headroom})
    flow = g.gateway.flow
    try:
        async with aiohttp.ClientSession() as s:
            await _quiet_once(s, g, rep)
            noisy = [asyncio.create_task(ask(s, g.url, "k-noisy", f"n{i}")) for i in range(4)]
            room = 2 if headroom else 3
            await until(lambda: rep.open_count() == room and len(flow.queue) == 4 - room, what="noisy to take its slots")
            q1 = asyncio.create_task(ask(s, g.url, "k-quiet", "q1"))
            if headroom:
                await until(lambda: "q1" in rep.arrived, what="the quiet request to go straight on")
                assert len(flow.queue) == 2 and rep.open_count() == 3
                rep.gates[rep.arrived.index("q1")].set()  # the quiet request ends: nothing of its in flight
                await asyncio.sleep(0.2)
                assert len(flow.queue) == 2 and rep.open_count() == 2, "the headroom is kept while the quiet tenant is recent"
                await until(lambda: len(flow.queue) == 1 and rep.open_count() == 3, timeout_s=5.0,
                            what="the noisy tenant to take the headroom once the quiet one is idle")
            else:
                await until(lambda: len(flow.queue) == 2, what="the quiet request to be held")
                assert "q1" not in rep.arrived
                rep.release(1)
                await until(lambda: "q1" in rep.arrived, what="the quiet request released first (fair order)")
            rep.drain()
            assert all(r[0] == 200 for r in await asyncio.gather(q1, *noisy))
    finally:
        await g.close()
        await rep.close()


@pytest.mark.parametrize("engine_priority", [True, False])
async def test_engine_priority_tells_the_engine_who_is_under_its_share(tmp_path, tok, engine_priority):
    """flow.engine_priority: a request let on while its tenant is under its fair share carries
    vLLM's priority 0, one let on over it priority 1 (the engine then admits the first before the
    second from its own queue), and a light tenant's request is not held: it waits in the engine,
    first in line; off: no priority at all, and that request is held. One replica, 4 slots, fair
    share 2 each: noisy's first two go on under its share, its third over it (into the room the
    headroom leaves), its fourth is held; the quiet tenant's first request takes the headroom,
    its second finds the replica full; once the quiet tenant is idle, noisy is alone (its share is
    the pool) and its held request is released under it."""
    rep = await HeldReplica().start()
    g = await _gateway(tmp_path, tok, {"r0": rep.url}, {"max_num_seqs": 4, "headroom_reqs": 1,
                                                         "engine_priority": engine_priority})
    flow = g.gateway.flow
    try:
        async with aiohttp.ClientSession() as s:
            await _quiet_once(s, g, rep)
            noisy = []
            for i in range(4):
                noisy.append(asyncio.create_task(ask(s, g.url, "k-noisy", f"n{i}")))
                await asyncio.sleep(0.02)  # in order
            await until(lambda: rep.open_count() == 3 and len(flow.queue) == 1, what="noisy to fill up to the headroom")
            q1 = asyncio.create_task(ask(s, g.url, "k-quiet", "q1"))
            await until(lambda: "q1" in rep.arrived, what="the quiet request to go straight on")
            q2 = asyncio.create_task(ask(s, g.url, "k-quiet", "q2"))  # the replica is full (4 open)
            if engine_priority:
                await until(lambda: "q2" in rep.arrived, what="the quiet request to go on into the engine's queue")
                assert rep.open_count() == 5 and len(flow.queue) == 1
            else:
                await until(lambda: len(flow.queue) == 2, what="the quiet request to be held")
            for q in ("q1", "q2"):
                await until(lambda q=q: q in rep.arrived, what=f"{q} to reach the replica")
                rep.gates[rep.arrived.index(q)].set()
            await until(lambda: len(rep.arrived) == 7, timeout_s=5.0, what="the held request, once the quiet tenant is idle")
            got = {b["messages"][-1]["content"]: b.get("priority") for b in rep.bodies}
            if engine_priority:
                assert got == {"q0": 0, "n0": 0, "n1": 0, "n2": 1, "q1": 0, "q2": 0, "n3": 0}, got
            else:
                assert set(got.values()) == {None}, got
            rep.drain()
            assert all(r[0] == 200 for r in await asyncio.gather(q1, q2, *noisy))
    finally:
        await g.close()
        await rep.close()


async def test_an_engine_that_refuses_priorities_serves_the_request_without_one(tmp_path, tok, caplog):
    """flow.engine_priority on an engine that does not schedule by priority (vLLM's default policy
    answers 400 to any priority but 0): the refused request is sent again without its priority and
    served, the gateway says so once, and that replica's later requests go without one at once."""
    rep = await HeldReplica().start()
    rep.fcfs = True
    g = await _gateway(tmp_path, tok, {"r0": rep.url}, {"max_num_seqs": 4, "headroom_reqs": 1, "engine_priority": True})
    flow = g.gateway.flow
    try:
        with caplog.at_level(logging.WARNING, logger="warmroute.gateway"):
            async with aiohttp.ClientSession() as s:
                await _quiet_once(s, g, rep)
                noisy = []
                for i in range(3):  # as above: n0 and n1 under noisy's share (priority 0), n2 over it (1)
                    noisy.append(asyncio.create_task(ask(s, g.url, "k-noisy", f"n{i}")))
                    await asyncio.sleep(0.02)
                await until(lambda: rep.open_count() == 3, what="noisy's three requests, the third without its priority")
                assert rep.refused == ["n2"] and len(flow.queue) == 0
                got = {b["messages"][-1]["content"]: b.get("priority") for b in rep.bodies}
                assert got == {"q0": 0, "n0": 0, "n1": 0, "n2": None}, got
                n3 = asyncio.create_task(ask(s, g.url, "k-noisy", "n3"))  # over its share again, while the quiet one is recent
                rep.release(1)  # n0 ends: n3 may take its slot
                await until(lambda: "n3" in rep.arrived, timeout_s=5.0, what="n3")
                assert rep.refused == ["n2"] and rep.bodies[-1].get("priority") is None  # no second refusal
                rep.drain()
                assert all(r[0] == 200 for r in await asyncio.gather(n3, *noisy))
        assert sum("refuses request priorities" in r.getMessage() for r in caplog.records) == 1
    finally:
        await g.close()
        await rep.close()


async def test_an_unsaturated_pool_lets_everything_straight_through(tmp_path, tok):
    rep = await HeldReplica().start()
    g = await _gateway(tmp_path, tok, {"r0": rep.url}, {"max_num_seqs": 64})
    try:
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(ask(s, g.url, "k-quiet", f"q{i}")) for i in range(20)]
            await until(lambda: rep.open_count() == 20)
            assert len(g.gateway.flow.queue) == 0
            rep.drain()
            await asyncio.gather(*tasks)
            text = await _metrics(s, g)
            assert _metric(text, "warmroute_gateway_flow_admissions_total", tenant_hash=tenant_hash("quiet"), path="direct") == 20
            assert _metric(text, "warmroute_gateway_flow_queue_wait_seconds_count", tenant_hash=tenant_hash("quiet"),
                           priority="standard") == 0
    finally:
        await g.close()
        await rep.close()


async def test_switched_off_nothing_is_held(tmp_path, tok):
    rep = await HeldReplica().start()
    g = await _gateway(tmp_path, tok, {"r0": rep.url}, {"enabled": False})
    try:
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(ask(s, g.url, "k-noisy", f"n{i}")) for i in range(5)]
            await until(lambda: rep.open_count() == 5, what="all five at the replica (slots are 2)")
            rep.drain()
            assert all(st == 200 for st, _, _ in await asyncio.gather(*tasks))
            assert "warmroute_gateway_flow_admissions_total{" not in await _metrics(s, g)
    finally:
        await g.close()
        await rep.close()


async def test_the_decision_span_says_how_the_request_passed(tmp_path, tok):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    rep = await HeldReplica().start()
    g = await _gateway(tmp_path, tok, {"r0": rep.url}, tracer_provider=provider)
    try:
        async with aiohttp.ClientSession() as s:
            fill = await _fill(s, g, rep)
            held = asyncio.create_task(ask(s, g.url, "k-quiet", "q", {"X-Warmroute-Priority": "batch"}))
            await until(lambda: len(g.gateway.flow.queue) == 1)
            await asyncio.sleep(0.1)
            rep.release(1)
            await until(lambda: "q" in rep.arrived)
            rep.drain()
            await asyncio.gather(held, *fill)
        routes = [sp for sp in exporter.get_finished_spans() if sp.name == "warmroute.route"]
        by_path = {sp.attributes["warmroute.flow.path"]: sp.attributes for sp in routes}
        assert by_path["direct"]["warmroute.flow.wait_s"] == 0.0
        rel = by_path["released"]
        assert rel["warmroute.flow.priority"] == "batch" and rel["warmroute.flow.wait_s"] >= 0.1
        assert rel["warmroute.flow.weight"] == 1.0 and rel["warmroute.flow.held_ahead"] == 0
    finally:
        await g.close()
        await rep.close()


async def test_tenant_labels_in_metrics_are_capped_and_the_rest_share_other(tmp_path, tok):
    """telemetry.max_tenant_labels: the first tenants seen keep their own tenant_hash label on the
    request and flow metrics; tenants beyond the cap (here JWT tenants, which come and go) are
    counted under "other", so the scrape does not grow with every tenant ever seen."""
    rep = await HeldReplica().start()
    g = await _gateway(tmp_path, tok, {"r0": rep.url}, {"max_num_seqs": 64}, telemetry={"max_tenant_labels": 2})
    try:
        async with aiohttp.ClientSession() as s:
            rep.drain()  # answer everything at once
            for key in ("k-filler", "k-quiet"):
                assert (await ask(s, g.url, key, "hello"))[0] == 200
            for i in range(5):
                auth = {"Authorization": f"Bearer {token_for(f'jwt-{i}')}"}
                assert (await ask(s, g.url, "", "hello", headers=auth))[0] == 200
            text = await _metrics(s, g)
    finally:
        await g.close()
        await rep.close()
    for name in ("warmroute_gateway_tenant_requests_total", "warmroute_gateway_flow_admissions_total"):
        assert _metric(text, name, tenant_hash=tenant_hash("filler")) == 1
        assert _metric(text, name, tenant_hash=tenant_hash("quiet")) == 1
        assert _metric(text, name, tenant_hash="other") == 5
        assert _metric(text, name, tenant_hash=tenant_hash("jwt-0")) == 0
    assert sum(f'tenant_hash="{tenant_hash(f"jwt-{i}")}"' in text for i in range(5)) == 0
