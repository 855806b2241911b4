"""The conversations-about-images benchmark's short form (loadtests/bench_media.py; its full run
is a documented command): both variants serve the same conversations without errors on sims that
expand each image into `--image-tokens` tokens; with the gateway's keys for the blocks past an image
every follow-up goes back to its conversation's replica and finds more of its prompt cached than
without them (each turn then routed by the text before the image alone)."""
from __future__ import annotations

from loadtests.bench_media import main_async, parse_args, stream


async def test_short_run_sends_follow_ups_back_to_the_replica_that_holds_their_image():
    args = parse_args(["--conversations", "8", "--turns", "3", "--rate", "2", "--think-s", "0.5"])
    reqs = stream(args)
    assert [(r.body, r.arrival_s, r.after) for r in reqs] == [(r.body, r.arrival_s, r.after) for r in stream(args)]
    assert len(reqs) == 24 and [r.after for r in reqs[:3]] == [-1, 0, 1]
    report = await main_async(args)
    (kept,), (off,) = report["runs"]["120.0"], report["runs"]["0.0"]
    for r in (kept, off):
        assert r["requests"] == 24 and r["errors"] == 0 and r["follow_ups"] == 16, r
    assert kept["follow_ups_back_home"] == 16 > off["follow_ups_back_home"], (kept, off)
    assert kept["hit_ratio"] > off["hit_ratio"], (kept, off)


def test_the_sims_expand_an_image_into_the_tokens_asked():
    from loadtests.sim.openai_requests import chat_messages

    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what?"},
                                                      {"type": "image_url", "image_url": {"url": "data:x"}}]}]}
    plain, padded = chat_messages(body, media=True)[0]["content"], chat_messages(body, media=True, media_tokens=5)[0]["content"]
    assert padded == plain.replace("\nwhat?", " pad pad pad pad pad\nwhat?") and plain.startswith("<image_url ")


def test_with_shared_images_the_conversations_ask_about_a_few_popular_ones():
    args = parse_args(["--conversations", "40", "--turns", "2", "--images", "3"])
    reqs = stream(args)

    def image(r):
        return next(p["image_url"]["url"] for m in r.body["messages"] if isinstance(m["content"], list)
                    for p in m["content"] if p["type"] == "image_url")
    firsts = [image(r) for r in reqs if r.after < 0]
    counts = sorted((firsts.count(u) for u in set(firsts)), reverse=True)
    assert len(counts) == 3 and counts[0] > counts[-1], counts  # weighted 1/i: some more asked about than others
    assert all(image(r) == image(reqs[r.after]) for r in reqs if r.after >= 0)  # a follow-up keeps its image
    questions = [r.body["messages"][-1]["content"][0]["text"] for r in reqs if r.after < 0]
    assert len(set(questions)) == len(questions)  # each conversation asks its own
