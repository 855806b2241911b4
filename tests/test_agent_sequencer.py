"""The ordering / gap / replay / resync state machine, without sockets."""
from __future__ import annotations

from replica_agent.transport import Deliver, RequestReplay, Resync, Sequencer


def P(seq):
    return f"p{seq}".encode()


def delivered(actions):
    return [a.seq for a in actions if isinstance(a, Deliver)]


def test_in_order_delivers_each_once():
    s = Sequencer(replay_available=True)
    out = []
    for i in range(5):
        out += s.live(i, P(i))
    assert delivered(out) == [0, 1, 2, 3, 4] and s.stats.resyncs == 0


def test_gap_replayed_fully():
    s = Sequencer(replay_available=True)
    out = s.live(0, P(0)) + s.live(1, P(1))
    out += s.live(4, P(4))
    assert out[-1] == RequestReplay(2)
    out += s.live(5, P(5))  # buffered during the replay
    for i in range(2, 6):  # the engine replays everything >= 2, including what we buffered
        out += s.replayed(i, P(i))
    out += s.replay_done()
    assert delivered(out) == [0, 1, 2, 3, 4, 5]
    assert not any(isinstance(a, Resync) for a in out)
    assert s.stats.replays == 1 and s.stats.replayed == 4 and s.stats.duplicates >= 2


def test_unreplayable_gap_resyncs_then_continues():
    s = Sequencer(replay_available=True)
    out = s.live(0, P(0)) + s.live(5, P(5))
    assert out[-1] == RequestReplay(1)
    out2 = s.replayed(3, P(3)) + s.replayed(4, P(4)) + s.replayed(5, P(5)) + s.replay_done()
    assert isinstance(out2[0], Resync) and "3" in out2[0].reason
    assert delivered(out2) == [3, 4, 5]
    assert delivered(s.live(6, P(6))) == [6]


def test_empty_replay_or_failure_resyncs_and_drains_buffer():
    s = Sequencer(replay_available=True)
    s.live(0, P(0))
    assert s.live(3, P(3)) == [RequestReplay(1)]
    s.live(4, P(4))
    out = s.replay_done()
    assert isinstance(out[0], Resync) and delivered(out) == [3, 4]
    s2 = Sequencer(replay_available=True)
    s2.live(0, P(0))
    s2.live(2, P(2))
    out = s2.replay_failed("timeout")
    assert isinstance(out[0], Resync) and "timeout" in out[0].reason and delivered(out) == [2]


def test_no_replay_endpoint_resyncs_on_gap():
    s = Sequencer(replay_available=False)
    s.live(0, P(0))
    out = s.live(2, P(2))
    assert isinstance(out[0], Resync) and delivered(out) == [2]


def test_late_join_asks_replay_from_zero():
    s = Sequencer(replay_available=True)
    assert s.live(7, P(7)) == [RequestReplay(0)]
    out = sum((s.replayed(i, P(i)) for i in range(0, 8)), []) + s.replay_done()
    assert delivered(out) == list(range(8)) and s.stats.resyncs == 0


def test_engine_restart_resyncs():
    s = Sequencer(replay_available=True)
    for i in range(4):
        s.live(i, P(i))
    out = s.live(0, P(0))
    assert isinstance(out[0], Resync) and "restart" in out[0].reason
    assert delivered(out) == [0] and s.stats.restarts == 1
    assert delivered(s.live(1, P(1))) == [1]


def test_buffer_overflow_during_replay_resyncs():
    s = Sequencer(replay_available=True, max_buffered=2)
    s.live(0, P(0))
    s.live(5, P(5))
    s.live(6, P(6))
    out = s.live(7, P(7))
    assert isinstance(out[0], Resync) and delivered(out) == [7]
    assert s.replayed(1, P(1)) == []  # stale replay replies are ignored
    assert delivered(s.live(8, P(8))) == [8]


from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 60),
    dropped=st.sets(st.integers(0, 59)),
    retain_from=st.integers(0, 60),
    replay=st.booleans(),
)
def test_property_delivery_in_order_or_resync(n, dropped, retain_from, replay):
    """Whatever is dropped and however little the engine retains: deliveries are strictly increasing;
    between two resyncs they are contiguous; every batch not lost for good is delivered."""
    s = Sequencer(replay_available=replay)
    actions = []

    def run(acts):
        for a in acts:
            if isinstance(a, RequestReplay):
                avail = [q for q in range(max(a.start_seq, retain_from), n_sent[0])]
                sub = []
                for q in avail:
                    sub += s.replayed(q, P(q))
                run(sub + s.replay_done())
            else:
                actions.append(a)

    n_sent = [0]
    for seq in range(n):
        n_sent[0] = seq + 1
        if seq in dropped:
            continue
        run(s.live(seq, P(seq)))
    got = [a.seq for a in actions if isinstance(a, Deliver)]
    assert got == sorted(set(got))
    segment = []
    for a in actions:
        if isinstance(a, Resync):
            segment = []
        else:
            if segment:
                assert a.seq == segment[-1] + 1
            segment.append(a.seq)
    # nothing received live is lost
    assert {q for q in range(n) if q not in dropped} <= set(got)
    if replay and retain_from == 0:  # everything replayable: no resync, nothing missing
        last_live = max((q for q in range(n) if q not in dropped), default=None)
        if last_live is not None:
            assert got == list(range(last_live + 1)) and s.stats.resyncs == 0
