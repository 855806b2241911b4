import httpx


def test_probe(vllm_replicas, e2e_system):
    system = e2e_system
    doc = " ".join(f"scratch probe item {i} of the batch check." for i in range(90))

    def go(label, body, path="/v1/completions"):
        r = httpx.post(system.url + path, json={"model": system.model, "max_tokens": 2, **body},
                       headers=system.headers("acme"), timeout=120)
        rid = r.headers.get("X-Request-Id")
        pred = None
        import time
        for _ in range(100):
            sp = [s for s in system.exporter.get_finished_spans() if s.attributes.get("warmroute.request_id") == rid
                  and "warmroute.predicted_cached_tokens" in s.attributes]
            if sp:
                pred = sp[0].attributes["warmroute.predicted_cached_tokens"]
                break
            time.sleep(0.05)
        print(label, r.status_code, "pred", pred, "usage", (r.json() or {}).get("usage") if r.status_code == 200 else r.text[:200])

    go("warm-up A", {"prompt": "A " + doc})
    go("warm A again", {"prompt": "A " + doc})
    go("batch [A, B]", {"prompt": ["A " + doc, "B " + doc]})
    go("batch [A, B] again", {"prompt": ["A " + doc, "B " + doc]})
    go("prompt_logprobs A", {"prompt": "A " + doc, "prompt_logprobs": 1})
    go("echo A logprobs", {"prompt": "A " + doc, "echo": True, "logprobs": 1})
    go("truncate A 64", {"prompt": "A " + doc, "truncate_prompt_tokens": 64})
    go("truncate A 64 again", {"prompt": "A " + doc, "truncate_prompt_tokens": 64})
