"""The cache salt (a contract: the engine's `cache_salt`, and so tenant isolation, depends on it).

    cache_salt = base64url( HMAC-SHA256(secret, scope_id) )   without padding: 43 characters

scope_id is the tenant id (default) or the user id (scope "user"; a request without a user id
falls back to its tenant). NOTE: with scope "user" the bare user id is the scope, as the contract
says, so user ids must be unique across tenants (JWT `sub` of one issuer is). The alphabet is [A-Za-z0-9_-], so the salt always satisfies vLLM's
rules (non-empty, <= 128 chars, no '@', '/', '\\' or NUL). Block keys are computed with the same
salt, so a tenant's keys never match another tenant's blocks.

The secret comes from a file (a mounted Kubernetes Secret) or the environment variable
WARMROUTE_SALT_SECRET, never from the config file. With authentication switched off and no
secret, the fixed documented `NO_AUTH_DEFAULT_SECRET` is used: there is a single tenant then, so
there is nothing to separate, and a fixed value keeps salts (and so the engines' caches) stable
across restarts and across gateway workers and replicas. With authentication on, a secret is
required (the config check refuses to start without one).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import os
from pathlib import Path

__all__ = ["NO_AUTH_DEFAULT_SECRET", "SALT_SECRET_ENV", "derive_salt", "load_salt_secret", "SaltDeriver"]

SALT_SECRET_ENV = "WARMROUTE_SALT_SECRET"
# Used only with --no-auth and no configured secret (single tenant: no isolation to protect).
NO_AUTH_DEFAULT_SECRET = b"warmroute/no-auth/default-salt-secret/v1"


def derive_salt(secret: bytes, scope_id: str) -> str:
    """base64url(HMAC-SHA256(secret, scope_id)) without padding (43 chars)."""
    if not secret:
        raise ValueError("salt secret is empty: set --salt-secret-file or WARMROUTE_SALT_SECRET")
    digest = hmac.new(secret, scope_id.encode("utf-8"), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def load_salt_secret(secret_file: str | None, env: dict[str, str] | None = None) -> bytes | None:
    """The secret from a file (trailing newline stripped) or WARMROUTE_SALT_SECRET; None if neither."""
    if secret_file:
        raw = Path(secret_file).read_bytes().rstrip(b"\r\n")
        if not raw:
            raise ValueError(f"salt secret file {secret_file} is empty")
        return raw
    value = (env if env is not None else os.environ).get(SALT_SECRET_ENV)
    if value:
        return value.encode("utf-8")
    return None


class SaltDeriver:
    """Derives (and memoises) the salt of a scope; scope is "tenant" or "user"."""

    __slots__ = ("_secret", "scope", "_cache")

    def __init__(self, secret: bytes, scope: str = "tenant") -> None:
        if scope not in ("tenant", "user"):
            raise ValueError(f"salt.scope must be 'tenant' or 'user', got {scope!r}")
        if not secret:
            raise ValueError("salt secret is empty")
        self._secret = secret
        self.scope = scope
        self._cache: dict[str, str] = {}

    def salt_for(self, tenant_id: str, user_id: str | None = None) -> str:
        scope_id = tenant_id
        if self.scope == "user" and user_id:
            scope_id = user_id
        salt = self._cache.get(scope_id)
        if salt is None:
            if len(self._cache) > 65536:
                self._cache.clear()
            salt = self._cache[scope_id] = derive_salt(self._secret, scope_id)
        return salt
