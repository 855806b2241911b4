"""loadtests/vtime_fingerprint.py: the same tree fingerprints alike twice (the simulator is
deterministic for a seed), and a change of routing shows in the file."""
from __future__ import annotations

import json

from loadtests import vtime_fingerprint
from loadtests.vtime_fingerprint import fingerprints, main


def test_the_same_tree_fingerprints_alike_and_a_routing_change_shows(tmp_path, monkeypatch):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main([str(a), "--requests", "60"]) == 0 and main([str(b), "--requests", "60"]) == 0
    assert a.read_bytes() == b.read_bytes()
    runs = json.loads(a.read_text())
    assert len(runs) == 10 and all(r["summary"]["requests"] > 0 for r in runs.values())
    orig = vtime_fingerprint.simulate

    def other_seed(*args, **kw):  # another draw of the gateways' and policies' randomness
        kw["seed"] = kw.get("seed", 0) + 100
        return orig(*args, **kw)

    monkeypatch.setattr(vtime_fingerprint, "simulate", other_seed)
    changed = fingerprints(60)
    assert [k for k in runs if changed[k] != runs[k]], "no run's fingerprint moved"
