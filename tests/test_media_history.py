"""A chat with media past its first item (pure): the messages from the first with media as units
(gateway.chat_messages.history_units) and the keys that stand for their blocks
(hashing.history_keys), and how long a replica is taken to hold them (RoutingState.linger)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    # from the first item on: the item, then its message's text (a "string" template's order)
    assert len(u1) == 2 and len(u2) == 4 and u2[:2] == u1
    assert u1[0][1] == HISTORY_ITEM_TOKENS and u1[1][1] == 4 + len("what is this? " * 10) // 4
    assert u2[2][1] == 4 + len("A red square on white. " * 8) // 4
    chain = KeyChain("m", 16)
    parent, tail = chain.request_keys(list(range(40)))[-1], [1, 2, 3, 4, 5, 6, 7, 8]  # 2 full blocks, 8 ids left
    k1 = history_keys(parent, tail, u1, 16, salt="s")
    k2 = history_keys(parent, tail, u2, 16, salt="s")
    assert len(k1) == (8 + sum(t for _, t in u1)) // 16 and len(k2) == (8 + sum(t for _, t in u2)) // 16
    assert k2[:len(k1)] == k1 and len(set(k2)) == len(k2)
    # another image, tenant, adapter, text before the item or parent: nothing in common
    other = history_keys(parent, tail, history_units(_turns(OTHER)[1]), 16, salt="s")
    for diff in (other, history_keys(parent, tail, u2, 16, salt="t"), history_keys(parent, tail, u2, 16, salt="s", lora="x"),
                 history_keys(parent, tail[:-1] + [9], u2, 16, salt="s"), history_keys(parent + 1, tail, u2, 16, salt="s")):
        assert not set(diff) & set(k2)
    assert not set(k2) & set(chain.request_keys(list(range(40)) + list(range(4000))))  # never a text chain's


def test_a_popular_image_keys_alike_in_every_conversation_until_its_text():
    """Two conversations sending one image after the same text share the keys of the blocks the
    image fills (the engine keys those with the image's hash, so both find them cached where one
    was), and part where their questions do."""
    ask = [{"role": "user", "content": [{"type": "text", "text": "what is this? " * 8}, IMAGE]}]
    other = [{"role": "user", "content": [{"type": "text", "text": "how old is it? " * 8}, IMAGE]}]
    tail = [1, 2, 3]
    ka = history_keys(7, tail, history_units([SYSTEM, *ask]), 16)
    kb = history_keys(7, tail, history_units([SYSTEM, *other]), 16)
    image_blocks = (len(tail) + HISTORY_ITEM_TOKENS) // 16  # the blocks that end within the image
    assert ka[:image_blocks] == kb[:image_blocks] and not set(ka[image_blocks:]) & set(kb)
    assert len(ka) > image_blocks  # the question's own block
    # a unit too short to end a block still tells the keys after it apart
    short_a = [{"role": "user", "content": [IMAGE, {"type": "text", "text": "a"}]}, {"role": "assistant", "content": "x" * 400}]
    short_b = [{"role": "user", "content": [IMAGE, {"type": "text", "text": "b"}]}, {"role": "assistant", "content": "x" * 400}]
    ua, ub = history_units(short_a), history_units(short_b)
    assert (len(tail) + HISTORY_ITEM_TOKENS) // 16 == (len(tail) + HISTORY_ITEM_TOKENS + ua[1][1]) // 16  # ends no block
    ka, kb = history_keys(7, tail, ua, 16), history_keys(7, tail, ub, 16)
    assert ka[:image_blocks] == kb[:image_blocks] and not set(ka[image_blocks:]) & set(kb[image_blocks:])


def test_in_part_order_the_units_follow_the_parts_from_the_first_item():
    """An "openai" template (or the engines' --interleave-mm-strings) renders a message's parts in
    their order, the text before the first item among the request's own keys; a "string" one puts
    every item first in its message."""
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    msg = {"role": "user", "content": [text("before " * 8), IMAGE, text("between " * 20), OTHER, text("after")]}
    ordered = history_units([msg], in_part_order=True)
    assert [t for _, t in ordered] == [HISTORY_ITEM_TOKENS, len("between " * 20) // 4, HISTORY_ITEM_TOKENS,
                                       len("after") // 4, 4]
    first_string = history_units([msg])
    assert [t for _, t in first_string] == [HISTORY_ITEM_TOKENS, HISTORY_ITEM_TOKENS,
                                            4 + len("before " * 8 + "between " * 20 + "after") // 4]
    # the same image after other text between: in order its second item keys apart
    msg2 = {**msg, "content": [text("before " * 8), IMAGE, text("elsewhere " * 20), OTHER, text("after")]}
    ka, kb = (history_keys(7, [], history_units([m], in_part_order=True), 16) for m in (msg, msg2))
    assert ka[:HISTORY_ITEM_TOKENS // 16] == kb[:HISTORY_ITEM_TOKENS // 16] and ka[-1] != kb[-1]


def test_a_chat_without_media_has_no_units():
    assert history_units([SYSTEM, {"role": "user", "content": "hello"}]) == ()
    assert history_units("not a list") == ()
    assert history_units([{"role": "user", "content": [{"type": "text"}, IMAGE, "tail", 3]}])[1][1] == \
        4 + len("tail") // 4  # parts without text count nothing
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


_TEXT = {"type": "text", "text": "x"}
_part = st.one_of(st.text(max_size=60), st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=300)),
                  st.sampled_from([IMAGE, OTHER, {"type": "input_image", "image_url": "u"}, {"type": "audio_url"}]),
                  st.dictionaries(st.sampled_from(["type", "text", "x"]), st.one_of(st.none(), st.integers(), st.text(max_size=5))),
                  st.integers())
_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"])},
                                 optional={"content": st.one_of(st.none(), st.text(max_size=200), st.lists(_part, max_size=5)),
                                           "name": st.text(max_size=3)})


@settings(max_examples=200, deadline=None)
@given(st.lists(_message, max_size=6), st.lists(_message, min_size=1, max_size=4), st.booleans(),
       st.lists(st.integers(0, 1000), max_size=15))
def test_any_chat_a_later_turn_extends_keeps_its_units_and_keys(before, later, in_order, tail):
    """Whatever the messages, units and keys are a function of them, and a conversation that goes
    on (messages appended) begins with the same units and keys: its next turn matches its last."""
    chat = before + [{"role": "user", "content": [_TEXT, IMAGE]}]
    units, more = history_units(chat, in_part_order=in_order), history_units(chat + later, in_part_order=in_order)
    assert units and more[:len(units)] == units and units == history_units(list(chat), in_part_order=in_order)
    assert all(isinstance(d, int) and t >= 0 for d, t in more)
    keys, longer = history_keys(3, tail, units, 16), history_keys(3, tail, more, 16)
    assert longer[:len(keys)] == keys and len(set(longer)) == len(longer)
