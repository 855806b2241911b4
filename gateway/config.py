"""Gateway configuration: one dataclass tree, loaded from YAML, then environment overrides, then
command-line flags, then validated with errors that name the field (`ConfigError("proxy.
connect_timeout_s: must be > 0")`).

Precedence (later wins): defaults < YAML file < `WARMROUTE_<SECTION>__<FIELD>` environment
variables (values parsed as YAML scalars, e.g. `WARMROUTE_PROXY__MAX_ATTEMPTS=3`,
`WARMROUTE_POLICY__PARAMS__W_CACHE=1.5`) < flags. Secrets never live here: the salt secret,
the JWT HS256 secret and API keys are referenced by file path (mounted Kubernetes Secrets) or
environment variable name; inline API keys must be `sha256:HEX`.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from gateway.config_rules import ConfigError, check_files, validate

__all__ = [
    "ConfigError", "GatewayConfig", "ServerConfig", "ModelConfig", "ReplicaSpec", "MembershipConfig",
    "FeedConfig", "PolicyConfig", "AuthConfig", "JwtConfig", "TenantConfig", "SaltConfig", "ProxyConfig",
    "TelemetryConfig", "FlowConfig", "FlowTenantConfig", "load_config", "config_from_dict", "apply_args", "validate", "check_files", "ENV_PREFIX",
]

ENV_PREFIX = "WARMROUTE_"


@dataclass
class ServerConfig:
    host: str = "0.0.0.0"  # listen address of the API and admin ports
    port: int = 8080  # OpenAI API port (0: ephemeral, single worker only)
    admin_port: int = 8081  # /metrics /healthz /readyz /debug (0: ephemeral)
    workers: int = 1  # worker processes sharing the port (SO_REUSEPORT)
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413
    shutdown_grace_s: float = 30.0  # SIGTERM: stop accepting, drain streams for this long


@dataclass
class ModelConfig:
    name: str | None = None  # served model name (None: discovered from the replicas' /v1/models)
    tokenizer_dir: str | None = None  # HF tokenizer directory (None: built-in Qwen/ChatML)
    # what the engines run with: vLLM's --chat-template (a file, or the template itself; None: the
    # tokenizer's), --chat-template-content-format (auto, string, openai) and --default-chat-template-kwargs
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    default_chat_template_kwargs: dict = field(default_factory=dict)
    interleave_mm_strings: bool = False  # the engines' --interleave-mm-strings: media placeholders where the parts are
    block_size: int = 16  # KV block size in tokens (must equal the engines')
    max_model_len: int | None = None  # context limit (None: replicas' /v1/models, else tokenizer)
    tokenizer_workers: int = 1  # threads for tokenization off the event loop
    inline_tokenize_max_chars: int = 8192  # inputs up to this many characters tokenize on the loop (a thread hop costs more)
    # a replica's /tokenize checks the gateway's token ids of a request it answered, at most once per
    # this many seconds per replica (its first answer at once); 0: off (gateway.tokenize_check)
    tokenize_check_s: float = 60.0
    aliases: list[str] = field(default_factory=list)  # other model names accepted for this model
    # LoRA adapters the engines serve (vLLM --lora-modules NAME=PATH, on every replica): requests for
    # them go upstream under their own name and key their blocks apart (gateway.model)
    lora_adapters: list[str] = field(default_factory=list)
    # how often each replica's /v1/models is asked which other LoRA adapters it has loaded (at start or
    # at run time); a request for one goes only to replicas that listed it (gateway.model); 0: no periodic
    # look (a model discovered at start still takes the adapters its first answering replica listed); while
    # on, a request for a name not served looks again first (gateway.adapters)
    lora_discovery_s: float = 30.0


@dataclass
class ReplicaSpec:
    id: str  # replica id (as the agent reports it)
    url: str  # base URL, e.g. http://10.0.0.7:8000


@dataclass
class MembershipConfig:
    replicas: list[ReplicaSpec] = field(default_factory=list)  # static list
    dns_service: str | None = None  # headless Service name, e.g. vllm.llm.svc.cluster.local
    dns_port: int = 8000  # engine port behind the headless Service
    dns_refresh_s: float = 10.0  # re-resolve period
    health_path: str = "/health"  # active probe path
    health_interval_s: float = 2.0  # active probe period (a replica that answered a request within it is not probed)
    health_timeout_s: float = 1.0  # active probe timeout
    health_timeouts_to_down: int = 3  # consecutive probe timeouts before a replica counts as down
    eject_base_s: float = 1.0  # first passive ejection; doubles per consecutive failure
    eject_max_s: float = 30.0  # cap of the ejection backoff


@dataclass
class FeedConfig:
    url: str = "memory://"  # memory:// or redis://HOST:PORT/DB
    load_only: bool = False  # no feed: route by load only (explicit mode; /readyz does not wait for a feed)
    index_max_entries: int = 2_000_000  # bound of the KV index (entries)
    stale_after_s: float = 10.0  # a replica whose agent is silent this long is routed by load only
    inflight_poll_s: float = 0.1  # how often other gateways' in-flight counters are read (flow.busy_exchange_s while held)
    speculative_ttl_s: float = 2.0  # TTL of the chosen replica's speculatively inserted keys
    # a chat with media: the keys standing for its blocks past the first item (hashing.history_keys)
    # count on the replica it went to for this long, so the conversation's next turn finds it; 0: off
    media_history_ttl_s: float = 120.0
    inflight_ttl_s: float = 15.0  # a gateway's shared in-flight counters outlive it (killed) by at most this


@dataclass
class PolicyConfig:
    name: str = "cache_aware"  # see policies.registry.POLICY_NAMES
    params: dict[str, Any] = field(default_factory=dict)  # policy weights, e.g. w_cache, w_queue
    prior_prefill_s_per_token: float = 5e-5  # calibration prior
    prior_decode_step_s: float = 0.02  # calibration prior
    seed: int | None = None  # tie-break RNG seed (None: random)


@dataclass
class JwtConfig:
    hs256_secret_file: str | None = None  # file holding the shared HS256 secret
    hs256_secret_env: str | None = None  # or an environment variable holding it
    rs256_public_key_file: str | None = None  # PEM RSA public key
    jwks_file: str | None = None  # JWKS JSON file (RSA -> RS256, EC P-256 -> ES256)
    issuer: str | None = None  # required `iss` when set
    audience: str | None = None  # required `aud` when set
    tenant_claim: str = "tenant"  # claim holding the tenant id
    user_claim: str | None = "sub"  # claim holding the user id (None: no user)
    leeway_s: float = 0.0  # clock skew allowed on exp/nbf

    def enabled(self) -> bool:
        return bool(self.hs256_secret_file or self.hs256_secret_env or self.rs256_public_key_file or self.jwks_file)


@dataclass
class TenantConfig:
    models: list[str] | None = None  # allowed models (None: all)
    max_concurrent_reqs: int | None = None  # 429 beyond this many concurrent engine sequences (a batch x n counts each)
    max_rps: float | None = None  # 429 beyond this request rate


@dataclass
class AuthConfig:
    enabled: bool = True  # False only explicitly (--no-auth): single tenant
    api_keys_file: str | None = None  # YAML tenant -> [key (plain or sha256:HEX)]
    api_keys: dict[str, list[str]] = field(default_factory=dict)  # inline, sha256:HEX only
    api_keys_reload_s: float = 5.0  # re-read the keys file when it changed (rotation)
    jwt: JwtConfig = field(default_factory=JwtConfig)
    tenants: dict[str, TenantConfig] = field(default_factory=dict)  # per-tenant models and limits


@dataclass
class SaltConfig:
    secret_file: str | None = None  # file with the HMAC secret (else env WARMROUTE_SALT_SECRET)
    scope: str = "tenant"  # "tenant" or "user"


@dataclass
class ProxyConfig:
    connect_timeout_s: float = 2.0  # TCP connect to a replica
    first_byte_timeout_s: float = 300.0  # request sent -> first event of a stream; a non-streamed answer comes whole, so this bounds its generation
    idle_timeout_s: float = 120.0  # longest silence between two upstream chunks
    max_attempts: int = 2  # replicas tried before the first byte (1: no retry)
    pool_limit: int = 4096  # idle keep-alive connections kept per replica
    kv_cache_report_mode: str | None = None  # set vllm_xargs.kv_cache_report_mode (e.g. "full")
    force_include_usage: bool = True  # ask for usage upstream when streaming (stripped if unasked)


@dataclass
class TelemetryConfig:
    access_log: bool = False  # one JSON line per request at INFO (off: logging costs CPU)
    log_level: str = "INFO"
    service_name: str = "warmroute-gateway"  # OTEL service.name unless OTEL_SERVICE_NAME is set
    max_tenant_labels: int = 1000  # tenants with their own tenant_hash metric label per process; later: "other"


@dataclass
class FlowTenantConfig:
    weight: float | None = None  # share of a saturated pool, relative (None: keys file / JWT claim, else default_weight)
    priority: str | None = None  # the tenant's priority class (None: keys file / JWT claim, else default_priority)
    allowed_priorities: list[str] | None = None  # higher classes the tenant may ask for with the priority header


@dataclass
class FlowConfig:
    enabled: bool = True  # hold requests in the gateway when no replica has room (False: straight through)
    max_num_seqs: int | None = None  # sequence slots per replica (None: policy.params.max_num_seqs, else 256)
    engine_queue_reqs: int = 1  # requests left to wait inside each engine beyond its slots (refills a freed slot at once)
    headroom_reqs: int = 1  # slots per replica heavy tenants leave free while a light one is active (0: none)
    light_spill_s: float = 0.5  # a light tenant's request may lose this much prefill (s) to take a free slot elsewhere (0: off)
    engine_priority: bool = False  # tell the engines: vLLM priority 0 for light tenants' requests, 1 for the rest (needs --scheduling-policy priority)
    max_queue_penalty_s: float = 1.0  # a replica with more queued prefill than this (seconds) has no room
    max_queue_reqs_per_tenant: int = 1000  # held requests per tenant (all gateways); beyond: 429
    max_queue_wait_s: float = 30.0  # held longer than this: 429
    priorities: list[str] = field(default_factory=lambda: ["interactive", "standard", "batch"])  # classes, highest first
    default_priority: str = "standard"  # class of a request nothing else classifies
    priority_header: str = "X-Warmroute-Priority"  # request header naming a class (lower: always; higher: if allowed)
    default_weight: float = 1.0  # weight of a tenant nothing else weighs
    weight_claim: str = "warmroute_weight"  # JWT claim holding the tenant's weight
    priority_claim: str = "warmroute_priority"  # JWT claim holding the caller's class
    allowed_priorities_claim: str = "warmroute_allowed_priorities"  # JWT claim listing classes the header may ask for
    tenants: dict[str, FlowTenantConfig] = field(default_factory=dict)  # per tenant id
    release_interval_s: float = 0.02  # while requests are held: re-check room this often (besides first tokens and finishes)
    share_interval_s: float = 0.1  # exchange fair shares and queue lengths with the other gateways (feed) this often (1 s while none was seen)
    busy_exchange_s: float = 0.025  # while any gateway holds requests: that and the in-flight exchange run this often


@dataclass
class KeepAliveConfig:
    enabled: bool = False  # refresh the plan's long shared prefixes on their replicas before the engines' LRU evicts them
    idle_s: float = 2.0  # refresh a kept prefix its replica has not used for this long (a hit of its blocks, max_tokens 1)
    min_tokens: int = 1024  # only prefixes at least this long are kept (a shorter miss costs less than a refresh's slot)
    forget_s: float = 30.0  # a prefix no request used for this long is no longer kept
    kv_frac: float = 0.9  # a replica's kept prefixes stay under this share of its KV (its agent's report)
    max_per_replica: int = 256  # kept prefixes per replica at most (the least busy go first)
    max_in_flight: int = 4  # refreshes out at once per replica; a prefix is never refreshed twice at once
    max_waiting: int = 2  # no refresh to a replica whose last load report has more requests waiting
    timeout_s: float = 10.0  # a refresh not answered within this long is abandoned
    # refreshes carry vLLM priority -1, ahead of every request (engines: --scheduling-policy priority)
    engine_priority: bool = False


@dataclass
class ResponsesConfig:
    # the engines store Responses (vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1): previous_response_id,
    # background and GET / cancel by id are served, each on the replica holding the response
    store: bool = False
    ttl_s: float = 604800.0  # a stored response's record (its replica, its turn's messages) stays in the feed this long after its conversation's last turn
    max_turns: int = 10000  # records kept in each gateway process's memory besides (the least recently used go first)
    # a background response holds its tenant's slot, flow control's grant and its replica's in-flight
    # count until its engine says it ended, asked this often (gateway.background_holds)...
    background_poll_s: float = 1.0
    background_max_s: float = 3600.0  # ...and at most this long


@dataclass
class GatewayConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    feed: FeedConfig = field(default_factory=FeedConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    salt: SaltConfig = field(default_factory=SaltConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    keep_alive: KeepAliveConfig = field(default_factory=KeepAliveConfig)
    responses: ResponsesConfig = field(default_factory=ResponsesConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# dict -> dataclass tree, with field-naming errors

def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>") or type(tp).__name__ == "UnionType":
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, path)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return _build(tp, value, path)
    if tp is Any:
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        return [_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return {str(k): _convert(args[1], v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            try:
                if isinstance(value, str):
                    return int(value)
            except ValueError:
                pass
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:
                if isinstance(value, str):
                    return float(value)
            except ValueError:
                pass
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return str(value)
    return value


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in names]
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"{where}{unknown[0]}: unknown field (known: {', '.join(sorted(names))})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _convert(hints[f.name], data[f.name], f"{path}.{f.name}" if path else f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
            raise ConfigError(f"{path}.{f.name}: required")
    return cls(**kwargs)


def _deep_merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def env_overrides(env: Mapping[str, str]) -> dict:
    """`WARMROUTE_A__B__C=v` -> {"a": {"b": {"c": yaml(v)}}}; variables without `__` are ignored."""
    out: dict = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX):].split("__") if p]
        if not parts:
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        cur = out
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = value
    return out


def _env_fields(env: Mapping[str, str]) -> dict[str, str]:
    """dotted field path -> the environment variable that sets it (as env_overrides reads them)."""
    out = {}
    for name in env:
        if name.startswith(ENV_PREFIX) and "__" in name:
            parts = [p.lower() for p in name[len(ENV_PREFIX):].split("__") if p]
            if parts:
                out[".".join(parts)] = name
    return out


def _blame_env(exc: ConfigError, fields: Mapping[str, str]) -> ConfigError:
    """The same error, saying which environment variable set the field it is about (an error in
    `policy.params.w_cache` or `membership.replicas[0].url` is the variable's that set that field,
    or the whole mapping or list; `bogus: unknown field` is WARMROUTE_BOGUS__X's; an error about a
    section is a variable's inside it only when it names that variable's field)."""
    path, _, detail = str(exc).partition(": ")
    for field_path, var in fields.items():
        inside = field_path.startswith(path + ".") and (  # the error is about a section holding the field
            detail.startswith("unknown field") or field_path.rsplit(".", 1)[-1] in detail)
        if path == field_path or path.startswith(field_path + ".") or path.startswith(field_path + "[") or inside:
            out = ConfigError(f"{exc} (set by the environment variable {var}, not the config file)")
            out.env_var = var
            return out
    return exc


def config_from_dict(data: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> GatewayConfig:
    merged = dict(data or {})
    fields = _env_fields(env) if env else {}
    if env:
        merged = _deep_merge(merged, env_overrides(env))
    try:
        # `membership.replicas` also accepts "ID=URL" strings and {id: url} mappings.
        mem = merged.get("membership")
        if isinstance(mem, Mapping) and "replicas" in mem:
            merged["membership"] = dict(mem, replicas=_normalise_replicas(mem["replicas"], "membership.replicas"))
        cfg = _build(GatewayConfig, merged, "")
        validate(cfg)
    except ConfigError as exc:
        raise _blame_env(exc, fields) from None
    return cfg


def _normalise_replicas(value: Any, path: str) -> list:
    if isinstance(value, Mapping):
        return [{"id": str(k), "url": v} for k, v in value.items()]
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list of {{id, url}} or 'ID=URL' strings")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            out.append(parse_replica_arg(item, f"{path}[{i}]"))
        else:
            out.append(item)
    return out


def parse_replica_arg(text: str, path: str = "--replica") -> dict:
    rid, sep, url = text.strip().partition("=")
    if not sep or not rid or not url:
        raise ConfigError(f"{path}: expected ID=URL, got {text!r}")
    return {"id": rid, "url": url}


def load_config(path: str | None, env: Mapping[str, str] | None = None) -> GatewayConfig:
    data: Any = {}
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path}: invalid YAML: {exc}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {path}: the top level must be a mapping")
    return config_from_dict(data, dict(os.environ) if env is None else env)


# `warmroute gateway` flags that set one config field: (flag dest, section, field). A flag left
# unset is None; 0 is a value (e.g. --port 0: any free port).
_FLAG_FIELDS = (
    ("host", "server", "host"), ("port", "server", "port"), ("admin_port", "server", "admin_port"),
    ("workers", "server", "workers"), ("dns_service", "membership", "dns_service"),
    ("dns_port", "membership", "dns_port"), ("feed", "feed", "url"), ("policy", "policy", "name"),
    ("tokenizer", "model", "tokenizer_dir"), ("block_size", "model", "block_size"), ("model", "model", "name"),
    ("max_model_len", "model", "max_model_len"), ("api_keys", "auth", "api_keys_file"),
    ("salt_secret_file", "salt", "secret_file"),
)
# store_true switches: (flag dest, section, field, value when given)
_FLAG_SWITCHES = (("load_only", "feed", "load_only", True), ("no_auth", "auth", "enabled", False),
                  ("access_log", "telemetry", "access_log", True))


def apply_args(cfg: GatewayConfig, args: Any) -> GatewayConfig:
    """Flags of `warmroute gateway` over a config; re-validates."""
    for dest, section, name in _FLAG_FIELDS:
        value = getattr(args, dest, None)
        if value is not None:
            setattr(getattr(cfg, section), name, value)
    for dest, section, name, value in _FLAG_SWITCHES:
        if getattr(args, dest, False):
            setattr(getattr(cfg, section), name, value)
    replicas = getattr(args, "replica", None)
    if replicas:
        cfg.membership.replicas = [ReplicaSpec(**parse_replica_arg(r)) for r in replicas]
    validate(cfg)
    return cfg
