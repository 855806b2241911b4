"""Policy registry: name -> class, and `get_policy(name, **params)`.

Rule: every policy in `POLICY_NAMES` satisfies the `Policy` protocol and passes the conformance
suite (tests/test_policies_conformance.py). `DEFAULT_POLICY` is the product's policy. Parameters
are checked against the constructor's keyword signature before it runs, so a mistake reads as the
user wrote it, never as Python internals: an unknown name raises `PolicyParamError` (a TypeError)
naming it and listing the valid ones; a value of the wrong type (a number parameter given 'abc',
or a bool) raises `PolicyParamError` (a ValueError too) naming parameter, expected type and value;
numeric strings ("1.5", as environment variables arrive) are converted. Range checks stay in each
policy (ValueError). `policy_params(name)` lists a policy's parameters with their defaults.
"""
from __future__ import annotations

import inspect
import typing

from policies.base import Policy
from policies.cache_aware import CacheAwarePolicy
from policies.cache_plan import CachePlanPolicy
from policies.least_loaded import LeastLoadedPolicy
from policies.power_of_two import PowerOfTwoPolicy
from policies.prefix_hash import PrefixHashPolicy
from policies.random_policy import RandomPolicy
from policies.round_robin import RoundRobinPolicy

__all__ = ["POLICIES", "POLICY_NAMES", "DEFAULT_POLICY", "PolicyParamError", "get_policy", "policy_params"]

POLICIES: dict[str, type] = {
    cls.name: cls
    for cls in (CacheAwarePolicy, RoundRobinPolicy, RandomPolicy, LeastLoadedPolicy, PowerOfTwoPolicy, PrefixHashPolicy, CachePlanPolicy)
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
DEFAULT_POLICY = CacheAwarePolicy.name


class PolicyParamError(TypeError, ValueError):
    """A policy parameter that is unknown or of the wrong type; `param` is its name."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def policy_params(name: str) -> dict[str, tuple[type | None, object]]:
    """parameter -> (annotated scalar type or None, default) of a policy's constructor; a policy
    that passes its `**kwargs` to an embedded one names that class in `PARAMS_FROM`, whose
    parameters it then accepts too."""
    cls = _policy_class(name)
    out = _constructor_params(cls)
    inner = getattr(cls, "PARAMS_FROM", None)
    if inner is not None:
        out = {**_constructor_params(inner), **out}
    return out


def _constructor_params(cls: type) -> dict[str, tuple[type | None, object]]:
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - an unresolvable annotation only loses the type check
        hints = {}
    out = {}
    for p in inspect.signature(cls.__init__).parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        tp = hints.get(p.name)
        out[p.name] = (tp if tp in (int, float, str, bool) else None, p.default)
    return out


def _policy_class(name: str) -> type:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}") from None


def _coerce(policy: str, param: str, tp: type | None, value: object) -> object:
    if tp is None or tp is str:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise PolicyParamError(f"{param!r} of policy {policy} must be true or false, got {value!r}", param)
    if isinstance(value, bool):
        raise PolicyParamError(f"{param!r} of policy {policy} must be a number, got {value!r}", param)
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise PolicyParamError(f"{param!r} of policy {policy} must be a number, got {value!r}", param) from None
    if not isinstance(value, (int, float)):
        raise PolicyParamError(f"{param!r} of policy {policy} must be a number, got {value!r}", param)
    if tp is int:
        if float(value) != int(value):
            raise PolicyParamError(f"{param!r} of policy {policy} must be a whole number, got {value!r}", param)
        return int(value)
    return float(value)


def get_policy(name: str = DEFAULT_POLICY, **params) -> Policy:
    """A fresh policy instance; `params` go to its constructor (keyword only), checked first."""
    cls = _policy_class(name)
    accepted = policy_params(name)
    checked = {}
    for key, value in params.items():
        if key not in accepted:
            valid = ", ".join(accepted) if accepted else "none: it takes no parameters"
            raise PolicyParamError(f"unknown parameter {key!r} for policy {name} (valid: {valid})", key)
        checked[key] = _coerce(name, key, accepted[key][0], value)
    return cls(**checked)
