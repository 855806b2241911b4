"""The rules a gateway config must satisfy beyond its types, checked with errors that name the
field (`ConfigError("proxy.connect_timeout_s: must be > 0")`): `validate` (the values, per
section) and `check_files` (referenced files exist). gateway.config loads the config and runs
them; start-up and `--check-config` run them again (gateway.assemble).
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.auth import parse_key_entry
from policies.registry import POLICY_NAMES, PolicyParamError, get_policy

if TYPE_CHECKING:  # annotations only: gateway.config imports this module
    from gateway.config import GatewayConfig

__all__ = ["ConfigError", "validate", "check_files"]


class ConfigError(ValueError):
    """Invalid configuration; the message starts with the dotted field name. `env_var` names the
    environment variable that set the offending field (None: the file, a flag or a default)."""

    env_var: str | None = None


def _err(path: str, msg: str) -> ConfigError:
    return ConfigError(f"{path}: {msg}")


def validate(cfg: GatewayConfig) -> None:
    """Checks that types alone do not catch. Raises ConfigError naming the field."""
    for check in (_check_server, _check_model, _check_membership, _check_feed, _check_policy, _check_auth,
                  _check_proxy_and_telemetry, _check_flow, _check_keep_alive, _check_responses):
        check(cfg)


def _check_server(cfg: GatewayConfig) -> None:
    s = cfg.server
    for name in ("port", "admin_port"):
        v = getattr(s, name)
        if not 0 <= v <= 65535:
            raise _err(f"server.{name}", f"must be 0..65535, got {v}")
    if s.workers < 1:
        raise _err("server.workers", f"must be >= 1, got {s.workers}")
    if s.workers > 1 and (s.port == 0 or s.admin_port == 0):
        raise _err("server.workers", "several workers need fixed (non-zero) ports to share")
    if s.max_body_bytes < 1024:
        raise _err("server.max_body_bytes", "must be >= 1024")
    if s.shutdown_grace_s < 0:
        raise _err("server.shutdown_grace_s", "must be >= 0")


def _check_model(cfg: GatewayConfig) -> None:
    m = cfg.model
    if m.block_size <= 0:
        raise _err("model.block_size", f"must be > 0, got {m.block_size}")
    if m.max_model_len is not None and m.max_model_len <= 0:
        raise _err("model.max_model_len", "must be > 0")
    if m.tokenizer_workers < 1:
        raise _err("model.tokenizer_workers", "must be >= 1")
    if not m.tokenize_check_s >= 0:
        raise _err("model.tokenize_check_s", f"must be >= 0 (0: off), got {m.tokenize_check_s}")
    if not m.lora_discovery_s >= 0:
        raise _err("model.lora_discovery_s", f"must be >= 0 (0: off), got {m.lora_discovery_s}")
    if m.chat_template_content_format not in ("auto", "string", "openai"):
        raise _err("model.chat_template_content_format", f"must be auto, string or openai (vLLM's "
                   f"--chat-template-content-format), got {m.chat_template_content_format!r}")
    if {"chat_template", "tokenize"} & m.default_chat_template_kwargs.keys():
        raise _err("model.default_chat_template_kwargs", "may not set chat_template or tokenize (vLLM refuses them)")
    names = [m.name, *m.aliases]
    for a in m.lora_adapters:
        if not isinstance(a, str) or not a:
            raise _err("model.lora_adapters", f"each must be a non-empty name, got {a!r}")
        if a in names:
            raise _err("model.lora_adapters", f"{a!r} is also the model's name or an alias")
        names.append(a)


def _check_membership(cfg: GatewayConfig) -> None:
    mem = cfg.membership
    seen = set()
    for i, r in enumerate(mem.replicas):
        if not r.id:
            raise _err(f"membership.replicas[{i}].id", "must not be empty")
        if r.id in seen:
            raise _err(f"membership.replicas[{i}].id", f"duplicate replica id {r.id!r}")
        seen.add(r.id)
        if not (r.url.startswith("http://") or r.url.startswith("https://")):
            raise _err(f"membership.replicas[{i}].url", f"must start with http:// or https://, got {r.url!r}")
    if mem.replicas and mem.dns_service:
        raise _err("membership.dns_service", "set either a static replica list or a DNS service, not both")
    if not 0 < mem.dns_port <= 65535:
        raise _err("membership.dns_port", "must be 1..65535")
    for name in ("dns_refresh_s", "health_interval_s", "health_timeout_s", "eject_base_s", "eject_max_s"):
        if getattr(mem, name) <= 0:
            raise _err(f"membership.{name}", "must be > 0")
    if mem.health_timeouts_to_down < 1:
        raise _err("membership.health_timeouts_to_down", "must be >= 1")
    if mem.eject_max_s < mem.eject_base_s:
        raise _err("membership.eject_max_s", "must be >= eject_base_s")


def _check_feed(cfg: GatewayConfig) -> None:
    f = cfg.feed
    if not (f.url.startswith("memory://") or f.url.startswith("redis://") or f.url.startswith("rediss://")):
        raise _err("feed.url", f"must be memory:// or redis://HOST:PORT/DB, got {f.url!r}")
    if f.index_max_entries < 1:
        raise _err("feed.index_max_entries", "must be >= 1")
    for name in ("stale_after_s", "inflight_poll_s", "speculative_ttl_s", "inflight_ttl_s"):
        if getattr(f, name) <= 0:
            raise _err(f"feed.{name}", "must be > 0")
    if f.media_history_ttl_s < 0:
        raise _err("feed.media_history_ttl_s", "must be >= 0 (0: off)")


def _check_policy(cfg: GatewayConfig) -> None:
    p = cfg.policy
    if not p.name:
        raise _err("policy.name", "must not be empty")
    if p.name not in POLICY_NAMES:
        raise _err("policy.name", f"unknown policy {p.name!r} (known: {', '.join(sorted(POLICY_NAMES))})")
    if "copy_in_background" in p.params:  # needs a warm the gateway does not send: no copy would ever be made
        raise _err("policy.params.copy_in_background", "is a virtual-time design probe (loadtests/vtime_pacing.py); "
                   "the gateway does not warm replicas")
    for k, v in p.params.items():
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise _err(f"policy.params.{k}", f"must be a number or string, got {v!r}")
    try:
        get_policy(p.name, **p.params)  # policies are pure: building one checks its parameters
    except PolicyParamError as exc:  # names the parameter: blame that field
        raise _err(f"policy.params.{exc.param}", str(exc)) from None
    except (TypeError, ValueError) as exc:
        raise _err("policy.params", str(exc)) from None
    if p.prior_prefill_s_per_token <= 0:
        raise _err("policy.prior_prefill_s_per_token", "must be > 0")
    if p.prior_decode_step_s <= 0:
        raise _err("policy.prior_decode_step_s", "must be > 0")


def _check_auth(cfg: GatewayConfig) -> None:
    a = cfg.auth
    for tenant, keys in a.api_keys.items():
        for i, k in enumerate(keys):
            try:
                parse_key_entry(k, allow_plain=False, where=f"auth.api_keys.{tenant}[{i}]")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
    if a.api_keys_reload_s <= 0:
        raise _err("auth.api_keys_reload_s", "must be > 0")
    if a.jwt.leeway_s < 0:
        raise _err("auth.jwt.leeway_s", "must be >= 0")
    if a.jwt.hs256_secret_file and a.jwt.hs256_secret_env:
        raise _err("auth.jwt.hs256_secret_env", "set hs256_secret_file or hs256_secret_env, not both")
    for tenant, t in a.tenants.items():
        if t.max_concurrent_reqs is not None and t.max_concurrent_reqs < 1:
            raise _err(f"auth.tenants.{tenant}.max_concurrent_reqs", "must be >= 1")
        if t.max_rps is not None and t.max_rps <= 0:
            raise _err(f"auth.tenants.{tenant}.max_rps", "must be > 0")
    if cfg.salt.scope not in ("tenant", "user"):
        raise _err("salt.scope", f"must be 'tenant' or 'user', got {cfg.salt.scope!r}")


def _check_proxy_and_telemetry(cfg: GatewayConfig) -> None:
    px = cfg.proxy
    for name in ("connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s"):
        if getattr(px, name) <= 0:
            raise _err(f"proxy.{name}", "must be > 0")
    if px.max_attempts < 1:
        raise _err("proxy.max_attempts", "must be >= 1")
    if px.pool_limit < 1:
        raise _err("proxy.pool_limit", "must be >= 1")
    if cfg.telemetry.max_tenant_labels < 0:
        raise _err("telemetry.max_tenant_labels", "must be >= 0")
    if cfg.telemetry.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise _err("telemetry.log_level", f"unknown level {cfg.telemetry.log_level!r}")


_HEADER_NAME_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def _check_flow(cfg: GatewayConfig) -> None:
    f = cfg.flow
    for name, low in (("max_num_seqs", 1), ("engine_queue_reqs", 0), ("headroom_reqs", 0), ("max_queue_reqs_per_tenant", 0)):
        v = getattr(f, name)
        if v is not None and v < low:
            raise _err(f"flow.{name}", f"must be >= {low}, got {v}")
    for name in ("max_queue_penalty_s", "max_queue_wait_s", "release_interval_s", "share_interval_s", "busy_exchange_s",
                 "default_weight"):
        if not (getattr(f, name) > 0 and math.isfinite(getattr(f, name))):
            raise _err(f"flow.{name}", f"must be a finite number > 0, got {getattr(f, name)}")
    if not (f.light_spill_s >= 0 and math.isfinite(f.light_spill_s)):
        raise _err("flow.light_spill_s", f"must be a finite number >= 0, got {f.light_spill_s}")
    if not f.priorities:
        raise _err("flow.priorities", "must name at least one class")
    for i, p in enumerate(f.priorities):
        if not p or not p.isprintable() or len(p) > 64 or p in f.priorities[:i]:
            raise _err(f"flow.priorities[{i}]", f"must be a printable name of 1..64 characters, once, got {p!r}")
    known = f"(flow.priorities: {', '.join(f.priorities)})"
    if f.default_priority not in f.priorities:
        raise _err("flow.default_priority", f"unknown class {f.default_priority!r} {known}")
    if not _HEADER_NAME_RE.match(f.priority_header or ""):
        raise _err("flow.priority_header", f"not a valid HTTP header name: {f.priority_header!r}")
    for name in ("weight_claim", "priority_claim", "allowed_priorities_claim"):
        if not getattr(f, name):
            raise _err(f"flow.{name}", "must not be empty")
    for tenant, t in f.tenants.items():
        where = f"flow.tenants.{tenant}"
        if t.weight is not None and not (t.weight > 0 and math.isfinite(t.weight)):
            raise _err(f"{where}.weight", f"must be a finite number > 0, got {t.weight}")
        names = [(f"{where}.priority", t.priority)] if t.priority is not None else []
        names += [(f"{where}.allowed_priorities[{i}]", p) for i, p in enumerate(t.allowed_priorities or [])]
        for path, p in names:
            if p not in f.priorities:
                raise _err(path, f"unknown class {p!r} {known}")


def _check_keep_alive(cfg: GatewayConfig) -> None:
    k = cfg.keep_alive
    for name in ("idle_s", "forget_s", "timeout_s"):
        if not (getattr(k, name) > 0 and math.isfinite(getattr(k, name))):
            raise _err(f"keep_alive.{name}", f"must be a finite number > 0, got {getattr(k, name)}")
    if k.min_tokens < cfg.model.block_size:
        raise _err("keep_alive.min_tokens", f"must be at least one block (model.block_size {cfg.model.block_size}), got {k.min_tokens}")
    if not 0 < k.kv_frac <= 1:
        raise _err("keep_alive.kv_frac", f"must be in (0, 1], got {k.kv_frac}")
    for name in ("max_per_replica", "max_in_flight"):
        if getattr(k, name) < 1:
            raise _err(f"keep_alive.{name}", f"must be >= 1, got {getattr(k, name)}")
    if k.max_waiting < 0:
        raise _err("keep_alive.max_waiting", f"must be >= 0, got {k.max_waiting}")


def _check_responses(cfg: GatewayConfig) -> None:
    r = cfg.responses
    if not (r.ttl_s > 0 and math.isfinite(r.ttl_s)):
        raise _err("responses.ttl_s", f"must be a finite number > 0, got {r.ttl_s}")
    if r.max_turns < 1:
        raise _err("responses.max_turns", f"must be >= 1, got {r.max_turns}")
    for name in ("background_poll_s", "background_max_s"):
        v = getattr(r, name)
        if not (v > 0 and math.isfinite(v)):
            raise _err(f"responses.{name}", f"must be a finite number > 0, got {v}")


def check_files(cfg: GatewayConfig) -> None:
    """Checks that need the filesystem (referenced files exist); run at start and by --check-config."""
    refs = [
        ("auth.api_keys_file", cfg.auth.api_keys_file),
        ("auth.jwt.hs256_secret_file", cfg.auth.jwt.hs256_secret_file),
        ("auth.jwt.rs256_public_key_file", cfg.auth.jwt.rs256_public_key_file),
        ("auth.jwt.jwks_file", cfg.auth.jwt.jwks_file),
        ("salt.secret_file", cfg.salt.secret_file),
        ("model.tokenizer_dir", cfg.model.tokenizer_dir),
    ]
    ct = cfg.model.chat_template
    if ct and not any(c in ct for c in "{}\n"):  # not a template itself: a file, as vLLM reads it
        refs.append(("model.chat_template", ct))
    for path, value in refs:
        if value and not Path(value).exists():
            raise _err(path, f"file not found: {value}")
    if cfg.auth.enabled and not (cfg.auth.api_keys_file or cfg.auth.api_keys or cfg.auth.jwt.enabled()):
        raise _err("auth", "authentication is on but no credentials are configured: set auth.api_keys_file "
                           "(--api-keys), auth.api_keys or auth.jwt, or switch auth off explicitly (--no-auth)")
