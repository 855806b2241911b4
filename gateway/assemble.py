"""What a gateway config builds before any network I/O: the authenticator, the salt deriver and
the policy. Start-up and `--check-config` both run `check_startup`, so a config that checks valid
starts (short of ports and replicas), and one that would not start is refused by both with the
same message naming the field.
"""
from __future__ import annotations

import os
from pathlib import Path

from gateway.auth import ApiKeyStore, Authenticator, JwtVerifier, TenantPolicy, load_api_keys_file, load_jwks_file, parse_key_entry
from gateway.config import ConfigError, GatewayConfig, check_files
from gateway.salt import NO_AUTH_DEFAULT_SECRET, SaltDeriver, load_salt_secret
from policies.base import Policy
from policies.registry import get_policy

__all__ = ["build_authenticator", "build_salter", "build_policy", "check_startup"]


def check_startup(cfg: GatewayConfig) -> None:
    """Every check start-up makes before it opens a socket; raises ConfigError naming the field."""
    check_files(cfg)
    build_authenticator(cfg)
    build_salter(cfg)
    build_policy(cfg)


def build_authenticator(cfg: GatewayConfig) -> Authenticator:
    a = cfg.auth
    policies = {
        t: TenantPolicy(frozenset(tc.models) if tc.models is not None else None, tc.max_concurrent_reqs, tc.max_rps)
        for t, tc in a.tenants.items()
    }
    if not a.enabled:
        return Authenticator(enabled=False, policies=policies)
    tenants: dict[str, list[bytes]] = {}
    for t, keys in a.api_keys.items():
        tenants.setdefault(t, []).extend(parse_key_entry(k, allow_plain=False, where=f"auth.api_keys.{t}") for k in keys)
    if a.api_keys_file:
        try:
            for t, ds in load_api_keys_file(a.api_keys_file).items():
                tenants.setdefault(t, []).extend(ds)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"auth.api_keys_file: {exc}") from None
    try:
        return Authenticator(enabled=True, keys=ApiKeyStore(tenants), jwt_verifier=_jwt_verifier(cfg), policies=policies)
    except ValueError as exc:
        raise ConfigError(f"auth: {exc}") from None


def _jwt_verifier(cfg: GatewayConfig) -> JwtVerifier | None:
    j = cfg.auth.jwt
    if not j.enabled():
        return None
    hs = None
    if j.hs256_secret_file:
        hs = Path(j.hs256_secret_file).read_bytes().rstrip(b"\r\n")
    elif j.hs256_secret_env:
        v = os.environ.get(j.hs256_secret_env)
        if not v:
            raise ConfigError(f"auth.jwt.hs256_secret_env: environment variable {j.hs256_secret_env} is not set")
        hs = v.encode()
    pem = Path(j.rs256_public_key_file).read_bytes() if j.rs256_public_key_file else None
    try:
        jwks = load_jwks_file(j.jwks_file) if j.jwks_file else None
        return JwtVerifier(hs256_secret=hs, rs256_public_key_pem=pem, jwks=jwks, issuer=j.issuer, audience=j.audience,
                           tenant_claim=j.tenant_claim, user_claim=j.user_claim, leeway_s=j.leeway_s)
    except ValueError as exc:
        raise ConfigError(f"auth.jwt: {exc}") from None


def build_salter(cfg: GatewayConfig) -> SaltDeriver:
    try:
        secret = load_salt_secret(cfg.salt.secret_file)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"salt.secret_file: {exc}") from None
    if secret is None:
        if cfg.auth.enabled:
            raise ConfigError("salt.secret_file: a salt secret is required when authentication is on "
                              "(--salt-secret-file FILE or WARMROUTE_SALT_SECRET)")
        secret = NO_AUTH_DEFAULT_SECRET
    return SaltDeriver(secret, cfg.salt.scope)


def build_policy(cfg: GatewayConfig) -> Policy:
    try:
        return get_policy(cfg.policy.name, **cfg.policy.params)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"policy.params: {exc}") from None
