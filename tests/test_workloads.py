"""loadtests/workloads.py: deterministic, shared segments share leading blocks, both renderings."""
from __future__ import annotations

import pytest

from hashing import KeyChain
from loadtests.workloads import WORKLOADS, build_workload, output_token_ids, render_messages, render_token_ids


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_deterministic_and_consistent(name):
    a = build_workload(name, 60, seed=3, rate_rps=5.0)
    b = build_workload(name, 60, seed=3, rate_rps=5.0)
    assert a == b and len(a.requests) == 60
    assert [r.arrival_s for r in a.requests] == sorted(r.arrival_s for r in a.requests)
    assert len({r.request_id for r in a.requests}) == 60
    for r in a.requests[:10]:
        toks = render_token_ids(r)
        assert len(toks) == r.prompt_tokens
        assert render_token_ids(r) == toks
        msgs = render_messages(r)
        assert msgs and all(m["role"] in ("system", "user", "assistant") and m["content"] for m in msgs)
        words = sum(len(m["content"].split()) for m in msgs)
        assert abs(words - sum(s.n_tokens for s in r.segments)) == 0  # one pseudo-word per token
        assert r.salt
    c = build_workload(name, 60, seed=4, rate_rps=5.0)
    assert c != a


def test_shared_document_shares_leading_blocks_and_salt_separates_tenants():
    w = build_workload("multi_tenant", 200, seed=0, rate_rps=5.0, n_docs=2, n_tenants=2)
    chain = KeyChain("m", 16)
    by = {}
    for r in w.requests:
        by.setdefault((r.segments[1].seg_id, r.tenant), []).append(r)
    (doc, tenant), same = next((k, v) for k, v in by.items() if len(v) >= 2)
    k1 = chain.request_keys(render_token_ids(same[0]), salt=same[0].salt)
    k2 = chain.request_keys(render_token_ids(same[1]), salt=same[1].salt)
    doc_blocks = (same[0].segments[0].n_tokens + same[0].segments[1].n_tokens) // 16
    assert k1[:doc_blocks] == k2[:doc_blocks]
    other = next(v[0] for (d, t), v in by.items() if d == doc and t != tenant)
    k3 = chain.request_keys(render_token_ids(other), salt=other.salt)
    assert k3[0] != k1[0]  # same document, other tenant: nothing shared


def test_multi_turn_history_grows_and_quotes_the_answer():
    w = build_workload("multi_turn", 30, seed=1, rate_rps=2.0, turns=3)
    conv = sorted((r for r in w.requests if r.conversation == "c0"), key=lambda r: r.turn)
    assert [r.turn for r in conv] == [0, 1, 2]
    t0, t1 = render_token_ids(conv[0]), render_token_ids(conv[1])
    assert t1[: len(t0)] == t0
    assert t1[len(t0) : len(t0) + conv[0].max_output_tokens] == output_token_ids(conv[0])
    assert conv[1].arrival_s > conv[0].arrival_s


def test_zipf_is_skewed_and_hot_prefix_is_hot():
    w = build_workload("shared_docs_zipf", 2000, seed=0, rate_rps=10.0, n_docs=40)
    counts = {}
    for r in w.requests:
        counts[r.segments[1].seg_id] = counts.get(r.segments[1].seg_id, 0) + 1
    assert max(counts.values()) > 5 * (2000 / 40)
    h = build_workload("hot_prefix", 2000, seed=0, rate_rps=10.0, hot_share=0.5)
    hot = sum(r.segments[1].seg_id == "doc/0" for r in h.requests)
    assert 900 < hot < 1100


def test_closed_loop_and_bad_arguments():
    w = build_workload("no_sharing", 10, seed=0, rate_rps=None, concurrency=4)
    assert w.concurrency == 4 and all(r.arrival_s == 0 for r in w.requests)
    with pytest.raises(ValueError):
        build_workload("no_sharing", 10, rate_rps=None)
    with pytest.raises(ValueError, match="shared_docs"):
        build_workload("nope", 10)


def test_documents_of_exact_length_and_one_warmup_request_per_document():
    from loadtests.workloads import warmup_requests

    w = build_workload("shared_docs", 600, seed=3, rate_rps=24.0, n_docs=12, doc_tokens=3000, doc_jitter=0.0)
    docs = {r.segments[1].seg_id: r.segments[1].n_tokens for r in w.requests}
    assert len(docs) == 12 and set(docs.values()) == {3000}
    warm = warmup_requests(w)
    assert sorted(r.segments[1].seg_id for r in warm) == sorted(docs)  # one per document
    assert all(r.arrival_s == 0.0 for r in warm)
    assert not {r.segments[-1].seg_id for r in warm} & {r.segments[-1].seg_id for r in w.requests}  # their own questions
    assert warmup_requests(build_workload("no_sharing", 50, seed=0)) == []
    jittered = build_workload("shared_docs", 600, seed=3, rate_rps=24.0, n_docs=12, doc_tokens=3000)
    assert len({r.segments[1].n_tokens for r in jittered.requests}) > 1
    with pytest.raises(ValueError):
        build_workload("shared_docs", 10, doc_jitter=1.5)


def test_steady_sessions_keep_the_rate_up_for_the_whole_run():
    w = build_workload("multi_turn", 1500, seed=0, rate_rps=12.0, sessions=96, turns=6)
    assert len(w.requests) == 1500
    convs = {}
    for r in w.requests:
        convs.setdefault(r.conversation, []).append(r.turn)
    assert all(t == list(range(len(t))) for t in convs.values())  # turns in order
    t = [r.arrival_s for r in w.requests]
    span = t[-1] - t[0]
    first_half = sum(1 for x in t if x < t[0] + span / 2)
    assert 0.55 < first_half / len(t) < 0.8  # a tail as conversations end, no ramp-down over the run
    assert 9.0 < len(t) / (span * 0.7) < 16.0  # ~12 requests/s while every session is live
    with pytest.raises(ValueError):
        build_workload("multi_turn", 10, rate_rps=None, concurrency=4, sessions=4)


def test_text_can_be_rendered_to_the_nominal_token_count(tok):
    """The wall-clock benchmark renders segments as pseudo-words (~1.5 tokens each with the default
    vocabulary); with the measured words_per_token a segment is its nominal length in real tokens."""
    from loadtests.workloads import Segment, segment_text, text_words_per_token

    wpt = text_words_per_token(tok.encode_prompt)
    assert 0.5 < wpt < 0.9  # far from 1: the unscaled text is ~1.5x too long
    for n in (100, 3000):
        seg = Segment(f"doc/check/{n}", "user", n, "document")
        assert abs(len(tok.encode_prompt(segment_text(seg, wpt))) - n) <= 0.03 * n + 2
        assert len(tok.encode_prompt(segment_text(seg))) > 1.3 * n


@pytest.fixture(scope="module")
def default_tokenizer():
    from gateway.tokenization import TokenizerService

    with TokenizerService() as tok:  # the sims' default (Qwen's tokenizer and ChatML template)
        yield tok


def test_exact_word_counts_make_each_segment_its_nominal_length(default_tokenizer):
    from loadtests.workloads import exact_word_counts, segment_text, text_words_per_token

    enc = default_tokenizer.encode_prompt
    wpt = text_words_per_token(enc)
    w = build_workload("shared_docs", 12, seed=0, rate_rps=5.0, n_docs=6, doc_tokens=3000, question_tokens=100)
    words = exact_word_counts(w.requests, enc, wpt)
    segs = {s.seg_id: s for r in w.requests for s in r.segments}
    assert set(words) == set(segs)
    off_by_factor = []
    for sid, s in segs.items():
        assert abs(len(enc(segment_text(s, n_words=words[sid]))) - s.n_tokens) <= 1, sid
        off_by_factor.append(abs(len(enc(segment_text(s, wpt))) - s.n_tokens))
    assert max(off_by_factor) > 5  # the average factor alone leaves segments off: why the search exists


@pytest.mark.parametrize("name", ["shared_docs", "multi_turn", "no_sharing"])
def test_token_rendering_is_as_long_as_the_chat_template_makes_the_text(default_tokenizer, name):
    """vtime's token rendering and the wall clock's text through the engines' chat template agree in
    length (to the pseudo-words' +-1 per segment): a virtual-time run models the wall clock's load."""
    from loadtests.workloads import exact_word_counts, text_words_per_token

    tok = default_tokenizer
    wpt = text_words_per_token(tok.encode_prompt)
    w = build_workload(name, 20, seed=2, rate_rps=5.0)
    words = exact_word_counts(w.requests, tok.encode_prompt, wpt)
    for r in w.requests:
        n_real = len(tok.encode_chat(render_messages(r, wpt, words)))
        assert abs(n_real - len(render_token_ids(r))) <= len(r.segments) + 1, (r.request_id, n_real, r.prompt_tokens)
