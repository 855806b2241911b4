"""Policy registry: name -> class, and `get_policy(name, **params)`.

Rule: every policy in `POLICY_NAMES` satisfies the `Policy` protocol and passes the conformance
suite (tests/test_policies_conformance.py). `DEFAULT_POLICY` is the product's policy. Unknown
names and unknown parameters raise ValueError/TypeError saying what is accepted.
"""
from __future__ import annotations

from policies.base import Policy
from policies.cache_aware import CacheAwarePolicy
from policies.cache_plan import CachePlanPolicy
from policies.least_loaded import LeastLoadedPolicy
from policies.power_of_two import PowerOfTwoPolicy
from policies.prefix_hash import PrefixHashPolicy
from policies.random_policy import RandomPolicy
from policies.round_robin import RoundRobinPolicy

__all__ = ["POLICIES", "POLICY_NAMES", "DEFAULT_POLICY", "get_policy"]

POLICIES: dict[str, type] = {
    cls.name: cls
    for cls in (CacheAwarePolicy, RoundRobinPolicy, RandomPolicy, LeastLoadedPolicy, PowerOfTwoPolicy, PrefixHashPolicy, CachePlanPolicy)
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
DEFAULT_POLICY = CacheAwarePolicy.name


def get_policy(name: str = DEFAULT_POLICY, **params) -> Policy:
    """A fresh policy instance; `params` go to its constructor (keyword only)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}") from None
    try:
        return cls(**params)
    except TypeError as e:
        raise TypeError(f"bad parameters for policy {name!r}: {e}") from None
