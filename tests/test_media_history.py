"""A chat with media past its first item (pure): the messages from the first with media as units
(gateway.chat_messages.history_units) and the keys that stand for their blocks
(hashing.history_keys), and how long a replica is taken to hold them (RoutingState.linger)."""
from __future__ import annotations

import pytest

from gateway.chat_messages import HISTORY_ITEM_TOKENS, history_units
from gateway.index import KVIndex
from gateway.load import LoadTracker
from gateway.routing import RoutingState
from hashing.history_keys import history_keys
from hashing.keys import KeyChain
from policies.calibration import Calibrator

SYSTEM = {"role": "system", "content": "You describe images."}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
OTHER = {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB"}}


def _turns(image=IMAGE):
    one = [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "what is this? " * 10}, image]}]
    two = one + [{"role": "assistant", "content": "A red square on white. " * 8},
                 {"role": "user", "content": "and its size?"}]
    return one, two


def test_a_conversations_next_turn_begins_with_the_last_turns_units_and_keys():
    one, two = _turns()
    u1, u2 = history_units(one), history_units(two)
    assert len(u1) == 1 and len(u2) == 3 and u2[:1] == u1  # from the first message with media on
    assert u1[0][1] == 4 + len("what is this? " * 10) // 4 + HISTORY_ITEM_TOKENS
    assert u2[1][1] == 4 + len("A red square on white. " * 8) // 4
    chain = KeyChain("m", 16)
    parent, tail = chain.request_keys(list(range(40)))[-1], [1, 2, 3, 4, 5, 6, 7, 8]  # 2 full blocks, 8 ids left
    k1 = history_keys(parent, tail, u1, 16, salt="s")
    k2 = history_keys(parent, tail, u2, 16, salt="s")
    assert len(k1) == (8 + u1[0][1]) // 16 and len(k2) == (8 + sum(t for _, t in u2)) // 16
    assert k2[:len(k1)] == k1 and len(set(k2)) == len(k2)
    # another image, tenant, adapter, text before the item or parent: nothing in common
    other = history_keys(parent, tail, history_units(_turns(OTHER)[1]), 16, salt="s")
    for diff in (other, history_keys(parent, tail, u2, 16, salt="t"), history_keys(parent, tail, u2, 16, salt="s", lora="x"),
                 history_keys(parent, tail[:-1] + [9], u2, 16, salt="s"), history_keys(parent + 1, tail, u2, 16, salt="s")):
        assert not set(diff) & set(k2)
    assert not set(k2) & set(chain.request_keys(list(range(40)) + list(range(4000))))  # never a text chain's


def test_a_chat_without_media_has_no_units():
    assert history_units([SYSTEM, {"role": "user", "content": "hello"}]) == ()
    assert history_units("not a list") == ()
    assert history_units([{"role": "user", "content": [{"type": "text"}, IMAGE, "tail", 3]}])[0][1] == \
        4 + len("tail") // 4 + HISTORY_ITEM_TOKENS  # parts without text count nothing
    with pytest.raises(ValueError):
        history_keys(0, [], ((1, 16),), 0)


class _Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def _state(clock, ttl: float, max_entries: int = 1000) -> RoutingState:
    return RoutingState(KVIndex(clock=clock, max_entries=max_entries), LoadTracker(), Calibrator(),
                        speculative_ttl_s=2.0, media_history_ttl_s=ttl, clock=clock)


def test_the_replica_a_chat_went_to_holds_its_history_keys_for_their_ttl_here_and_at_the_other_gateways():
    clock = _Clock()
    st, other = _state(clock, 120.0), _state(clock, 120.0)
    st.share_copies = True
    keys = tuple(range(1000, 1040))
    st.linger("a", keys)
    assert st.index.match(keys)["a"].gpu_blocks == 40
    taken = st.take_shared()
    assert [(rid, k) for rid, k, _ in taken] == [("a", keys)] and taken[0][2] == pytest.approx(120.0)
    other.apply_shared(taken)
    clock.t += 119.0
    assert st.index.match(keys)["a"].gpu_blocks == 40 and other.index.match(keys)["a"].gpu_blocks == 40
    clock.t += 2.0
    assert st.index.match(keys) == {} and other.index.match(keys) == {}
    off = _state(clock, 0.0)  # feed.media_history_ttl_s: 0
    off.linger("a", keys)
    assert off.index.match(keys) == {}
    small = _state(clock, 120.0, max_entries=100)  # speculative keys past a quarter of the budget: no more
    small.linger("a", keys[:26])
    small.linger("b", keys[26:])
    assert small.index.match(keys[:26])["a"].gpu_blocks == 26 and small.index.match(keys[26:]) == {}


def test_a_message_digest_reads_all_of_it_and_takes_any_nesting_a_body_may_have():
    from gateway.chat_messages import _digest

    a = {"role": "user", "content": [IMAGE, {"type": "text", "text": "x"}], "name": "n"}
    assert _digest(a) == _digest(dict(reversed(list(a.items()))))  # key order does not matter
    for other in ({**a, "name": "m"}, {**a, "content": [OTHER, {"type": "text", "text": "x"}]},
                  {**a, "content": [{"type": "text", "text": "x"}, IMAGE]}, {**a, "extra": None},
                  {"role": "user", "content": [IMAGE, {"type": "text", "text": "x"}], "name": ["n"]}):
        assert _digest(other) != _digest(a), other
    assert _digest(["ab", "c"]) != _digest(["a", "bc"]) and _digest([1]) != _digest(["1"])
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    assert isinstance(_digest({**a, "x": deep}), int)
