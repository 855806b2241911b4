"""Pure routing policies (the score of the README's "What it does", step 6): no I/O, no asyncio.

`policies.base` is the interface; `policies.registry.get_policy(name, **params)` builds one;
`policies.calibration.Calibrator` estimates per-replica prefill and decode rates online.
"""
from policies.base import Candidate, Decision, Policy, PolicyBase, ReplicaView, RequestView
from policies.registry import DEFAULT_POLICY, POLICY_NAMES, get_policy

__all__ = ["Candidate", "Decision", "Policy", "PolicyBase", "ReplicaView", "RequestView", "DEFAULT_POLICY", "POLICY_NAMES", "get_policy"]
