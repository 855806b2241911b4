"""Identity: API keys and JWT bearer tokens -> (tenant id, user id); per-tenant model access and
limits. Pure: no sockets, no files read here except through the explicit `load_*` helpers.

Rules:
- Credentials come from `Authorization: Bearer <token>` (or `x-api-key: <key>`). A token shaped
  like a JWT (three base64url parts) is verified as a JWT when JWT verification is configured;
  anything else is an API key.
- API keys are held only as sha256 digests; a presented key is hashed and compared against every
  stored digest with `hmac.compare_digest` (no early exit), so timing says nothing about which.
  Several keys per tenant make rotation a matter of adding the new key, then removing the old.
- JWTs: the algorithm is pinned per key type and taken from the key, never trusted from the token:
  HS256 only with the configured shared secret; RS256 only with an RSA public key (PEM or a JWKS
  entry of kty RSA); ES256 only with an EC P-256 JWKS entry. `alg: none` and every other
  algorithm are refused, so an HS256 token "signed" with the RSA public key (algorithm confusion)
  never verifies. `exp` is required; `nbf`, `iss` and `aud` (when configured) are checked.
- No or bad credential: `ApiError(401)`. A tenant not allowed the model: `ApiError(403)`. Over a
  tenant's concurrency or rate limit: `ApiError(429)`.
- Tenant ids never leave the process in clear: logs, traces and metrics use `tenant_hash(id)`.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import jwt
import yaml

from gateway.errors import ApiError

__all__ = [
    "Identity", "ApiKeyStore", "JwtVerifier", "Authenticator", "TenantPolicy", "TenantLimiter",
    "tenant_hash", "hash_api_key", "parse_key_entry", "load_api_keys_file", "read_keys_file", "file_mtime",
    "NO_AUTH_TENANT",
]

NO_AUTH_TENANT = "default"  # the single tenant of --no-auth mode
_SHA_RE = re.compile(r"^sha256:([0-9a-fA-F]{64})$")
_JWT_RE = re.compile(r"^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*$")


def tenant_hash(tenant_id: str) -> str:
    """First 16 hex of sha256(tenant id): what logs, traces and metric labels carry."""
    return hashlib.sha256(tenant_id.encode("utf-8")).hexdigest()[:16]


def hash_api_key(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def parse_key_entry(entry: str, *, allow_plain: bool = True, where: str = "api key") -> bytes:
    """`sha256:HEX` -> the digest; a plain key -> its sha256 (only when `allow_plain`)."""
    if not isinstance(entry, str) or not entry:
        raise ValueError(f"{where}: must be a non-empty string")
    m = _SHA_RE.match(entry)
    if m:
        return bytes.fromhex(m.group(1))
    if entry.startswith("sha256:"):
        raise ValueError(f"{where}: 'sha256:' must be followed by 64 hex digits")
    if not allow_plain:
        raise ValueError(f"{where}: keys in the config file must be stored hashed as sha256:HEX "
                         "(put plain keys only in a mounted --api-keys file)")
    return hash_api_key(entry)


def load_api_keys_file(path: str | Path) -> dict[str, list[bytes]]:
    """YAML `tenant id -> [key, ...]` (plain or sha256:HEX), or `tenant id -> {keys: [...], ...}`
    (the other fields are flow control's: gateway.admission.load_tenant_flows) -> tenant -> digests."""
    out: dict[str, list[bytes]] = {}
    for tenant, entry in read_keys_file(path).items():
        keys = entry.get("keys") if isinstance(entry, dict) else entry
        if isinstance(keys, str):
            keys = [keys]
        if not isinstance(keys, list) or not keys:
            raise ValueError(f"api keys file {path}: tenant {tenant!r} needs a list of keys")
        out[tenant] = [parse_key_entry(k, where=f"api keys file {path}: tenant {tenant!r}") for k in keys]
    return out


def file_mtime(path: str | Path | None) -> float:
    """The keys file's modification time, 0 when unset or unreadable: its readers (the key store's
    reload, flow control's weights) re-read it when this changes."""
    try:
        return os.stat(path).st_mtime if path else 0.0
    except OSError:
        return 0.0


def read_keys_file(path: str | Path) -> dict[str, Any]:
    """The keys file's YAML: tenant id -> its entry (a key, a list of keys, or a mapping)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"api keys file {path}: expected a mapping tenant id -> list of keys")
    for tenant in data:
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"api keys file {path}: tenant ids must be non-empty strings, got {tenant!r}")
    return data


@dataclass(frozen=True, slots=True)
class Identity:
    tenant_id: str  # raw tenant id (never logged)
    user_id: str | None = None  # from a JWT claim, when configured and present
    method: str = "none"  # "api_key" | "jwt" | "trusted-header" | "none"
    claims: Mapping[str, Any] | None = field(default=None, compare=False)  # a verified JWT's claims (never logged)

    @property
    def tenant_hash(self) -> str:
        return tenant_hash(self.tenant_id)

    @property
    def identified(self) -> bool:
        """A tenant was identified (API key, JWT or a trusted gateway's header), not auth off."""
        return self.method != "none"


class ApiKeyStore:
    """Digests of every valid key with their tenant; lookup compares against all of them."""

    __slots__ = ("_entries",)

    def __init__(self, tenants: Mapping[str, list[bytes]]) -> None:
        self._entries: list[tuple[bytes, str]] = [(d, t) for t, ds in tenants.items() for d in ds]

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, presented: str) -> str | None:
        digest = hash_api_key(presented)
        found: str | None = None
        for stored, tenant in self._entries:  # no early exit: constant work per store size
            if hmac.compare_digest(stored, digest):
                found = tenant
        return found


class JwtVerifier:
    """Verifies JWTs with pinned algorithms per key type (module rules)."""

    def __init__(
        self,
        *,
        hs256_secret: bytes | None = None,
        rs256_public_key_pem: bytes | None = None,
        jwks: Mapping[str, Any] | None = None,
        issuer: str | None = None,
        audience: str | None = None,
        tenant_claim: str = "tenant",
        user_claim: str | None = "sub",
        leeway_s: float = 0.0,
    ) -> None:
        self._hs = hs256_secret or None
        self._rsa_static = None
        if rs256_public_key_pem:
            from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey
            from cryptography.hazmat.primitives.serialization import load_pem_public_key

            key = load_pem_public_key(rs256_public_key_pem)
            if not isinstance(key, RSAPublicKey):
                raise ValueError("jwt.rs256_public_key_file: not an RSA public key")
            self._rsa_static = key
        # (alg, kid) -> key object
        self._jwks: list[tuple[str, str | None, Any]] = []
        if jwks is not None:
            for i, entry in enumerate(jwks.get("keys", []) if isinstance(jwks, Mapping) else []):
                kty = entry.get("kty")
                if kty == "RSA":
                    alg = "RS256"
                elif kty == "EC" and entry.get("crv") == "P-256":
                    alg = "ES256"
                else:
                    continue  # symmetric or unsupported keys in a JWKS are ignored, never used
                if entry.get("alg") not in (None, alg):
                    continue
                if entry.get("use") not in (None, "sig"):
                    continue
                try:
                    key = jwt.PyJWK.from_dict(dict(entry), algorithm=alg).key
                except Exception as exc:  # noqa: BLE001
                    raise ValueError(f"jwks key #{i}: {exc}") from exc
                self._jwks.append((alg, entry.get("kid"), key))
        if not (self._hs or self._rsa_static or self._jwks):
            raise ValueError("JWT verification configured without any key (hs256 secret, RS256 PEM or JWKS)")
        self.issuer = issuer
        self.audience = audience
        self.tenant_claim = tenant_claim
        self.user_claim = user_claim
        self.leeway_s = leeway_s

    def _keys_for(self, header: Mapping[str, Any]) -> tuple[str, list[Any]]:
        """The algorithm (from the token, but only if a trusted key of that type exists) and the
        keys allowed to verify it: by `kid` when the token names one, else every key of the type."""
        alg = header.get("alg")
        if alg == "HS256" and self._hs:
            return alg, [self._hs]
        if alg in ("RS256", "ES256"):
            kid = header.get("kid")
            cands = [k for (a, kd, k) in self._jwks if a == alg and (kid is None or kd == kid)]
            if alg == "RS256" and self._rsa_static is not None and kid is None:
                cands.append(self._rsa_static)
            if cands:
                return alg, cands
            raise ApiError(401, "JWT signed with an unknown key", code="invalid_token")
        raise ApiError(401, f"JWT algorithm {alg!r} is not accepted", code="invalid_token")

    def verify(self, token: str) -> tuple[str, str | None]:
        """-> (tenant id, user id or None); ApiError(401) on any failure."""
        tenant, user, _ = self.verify_claims(token)
        return tenant, user

    def verify_claims(self, token: str) -> tuple[str, str | None, dict]:
        """-> (tenant id, user id or None, every claim); ApiError(401) on any failure."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise ApiError(401, "malformed JWT", code="invalid_token") from None
        alg, keys = self._keys_for(header)
        options: dict[str, Any] = {"require": ["exp"], "verify_aud": self.audience is not None}
        if self.issuer is not None:
            options["require"].append("iss")
        try:
            for i, key in enumerate(keys):
                try:
                    claims = jwt.decode(
                        token, key=key, algorithms=[alg], issuer=self.issuer, audience=self.audience,
                        leeway=self.leeway_s, options=options,
                    )
                    break
                except jwt.InvalidSignatureError:
                    if i == len(keys) - 1:
                        raise
        except jwt.ExpiredSignatureError:
            raise ApiError(401, "JWT expired", code="invalid_token") from None
        except jwt.ImmatureSignatureError:
            raise ApiError(401, "JWT not valid yet (nbf/iat in the future)", code="invalid_token") from None
        except jwt.InvalidAudienceError:
            raise ApiError(401, "JWT audience not accepted", code="invalid_token") from None
        except jwt.InvalidIssuerError:
            raise ApiError(401, "JWT issuer not accepted", code="invalid_token") from None
        except jwt.PyJWTError as exc:
            raise ApiError(401, f"JWT rejected: {type(exc).__name__}", code="invalid_token") from None
        tenant = claims.get(self.tenant_claim)
        if not isinstance(tenant, str) or not tenant:
            raise ApiError(401, f"JWT lacks the tenant claim {self.tenant_claim!r}", code="invalid_token")
        user = claims.get(self.user_claim) if self.user_claim else None
        return tenant, (str(user) if user is not None else None), claims


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    models: frozenset[str] | None = None  # models the tenant may use (None: all)
    max_concurrent_reqs: int | None = None  # concurrent requests (None: unlimited)
    max_rps: float | None = None  # requests per second, token bucket with burst = max(1, rps)


class Authenticator:
    """Credentials -> Identity. `enabled=False` is single-tenant mode (tenant NO_AUTH_TENANT)."""

    def __init__(self, *, enabled: bool, keys: ApiKeyStore | None = None, jwt_verifier: JwtVerifier | None = None,
                 policies: Mapping[str, TenantPolicy] | None = None) -> None:
        if enabled and not (keys and len(keys)) and jwt_verifier is None:
            raise ValueError("auth is enabled but no API keys and no JWT keys are configured "
                             "(set --api-keys FILE / auth.jwt, or --no-auth for single-tenant mode)")
        self.enabled = enabled
        self.keys = keys or ApiKeyStore({})
        self.jwt = jwt_verifier
        self.policies: Mapping[str, TenantPolicy] = policies or {}

    def replace_keys(self, keys: ApiKeyStore) -> None:
        self.keys = keys

    def authenticate(self, headers: Mapping[str, str]) -> Identity:
        if not self.enabled:
            return Identity(NO_AUTH_TENANT, None, "none")
        auth = headers.get("Authorization") or headers.get("authorization")
        token: str | None = None
        if auth:
            scheme, _, rest = auth.partition(" ")
            if scheme.lower() != "bearer" or not rest.strip():
                raise ApiError(401, "expected 'Authorization: Bearer <key or token>'", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
            token = rest.strip()
        else:
            token = headers.get("x-api-key") or headers.get("X-Api-Key")
        if not token:
            raise ApiError(401, "missing credentials: send 'Authorization: Bearer <API key or JWT>'",
                           code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
        if self.jwt is not None and _JWT_RE.match(token) and token.startswith("eyJ"):
            tenant, user, claims = self.jwt.verify_claims(token)
            return Identity(tenant, user, "jwt", claims)
        tenant = self.keys.lookup(token)
        if tenant is None:
            raise ApiError(401, "invalid API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return Identity(tenant, None, "api_key")

    def authorize_model(self, identity: Identity, model: str) -> None:
        pol = self.policies.get(identity.tenant_id)
        if pol is not None and pol.models is not None and model not in pol.models:
            raise ApiError(403, f"this tenant may not use model {model!r}", code="model_not_allowed", param="model")


class TenantLimiter:
    """Per-tenant concurrency and request-rate limits (token bucket). Pure: `now` is passed in.

    `acquire` raises ApiError(429) or returns; every successful acquire is paired with `release`.
    A slot is one engine request: a request the engine runs as several sequences (a completions
    batch, `n` > 1) takes one more per sequence (`widen`), at most the whole limit, so `n` cannot
    multiply a tenant's share of the engines; a request larger than the limit runs alone.
    Limits hold across gateways through what gateway.flow_share's exchange sets here: the requests
    the other gateways hold (`others_active`), this process's share of each tenant's rate (its share
    of the tenant's arrivals), and, while the exchange is away, its share of the concurrency
    limit (`concurrency_share`, 1/N of N gateways last seen). Alone, they are 0, 1 and 1.
    """

    def __init__(self, policies: Mapping[str, TenantPolicy]) -> None:
        self.policies = policies
        self._active: dict[str, int] = {}
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, last time)
        self.others_active: dict[str, int] = {}  # tenant -> requests other gateways hold
        self.rate_share: dict[str, float] = {}  # tenant -> share of max_rps this process admits (absent: 1)
        self.concurrency_share = 1.0  # share of max_concurrent_reqs this process admits alone
        self.arrivals: dict[str, int] = {}  # tenant -> requests asked (limited tenants), for the rate shares

    def acquire(self, tenant_id: str, now: float | None = None, *, slot: bool = True) -> bool:
        """True when a slot was taken (call release), False when the tenant has no limits; `slot`
        False: the request rate only (a request that puts no work on an engine)."""
        pol = self.policies.get(tenant_id)
        if pol is None or (pol.max_concurrent_reqs is None and pol.max_rps is None):
            return False
        self.arrivals[tenant_id] = self.arrivals.get(tenant_id, 0) + 1
        if pol.max_rps is not None:
            now = time.monotonic() if now is None else now
            rps = pol.max_rps * max(0.01, self.rate_share.get(tenant_id, 1.0))
            burst = max(1.0, rps)
            tokens, last = self._buckets.get(tenant_id, (burst, now))
            tokens = min(burst, tokens + (now - last) * rps)
            if tokens < 1.0:
                self._buckets[tenant_id] = (tokens, now)
                wait_s = (1.0 - tokens) / rps
                raise ApiError(429, "tenant request rate limit reached", code="rate_limit_exceeded",
                               headers={"Retry-After": str(max(1, int(wait_s + 0.999)))})
            self._buckets[tenant_id] = (tokens - 1.0, now)
        if not slot:
            return False
        if pol.max_concurrent_reqs is not None:
            n = self._active.get(tenant_id, 0)
            cap = max(1, math.ceil(pol.max_concurrent_reqs * self.concurrency_share))
            if n + self.others_active.get(tenant_id, 0) >= cap:
                raise ApiError(429, "tenant concurrent request limit reached", code="concurrency_limit_exceeded",
                               headers={"Retry-After": "1"})
            self._active[tenant_id] = n + 1
        return True

    def widen(self, tenant_id: str, more: int) -> int:
        """Slots beside the one `acquire` took for a request the engine runs as `more` + 1
        sequences, as many as the tenant's limit leaves room for one request (all of it, alone);
        raises ApiError(429) when its other requests leave too few. Returns the slots taken (release
        them with the first: `release(tenant_id, 1 + taken)`)."""
        pol = self.policies.get(tenant_id)
        if more <= 0 or pol is None or pol.max_concurrent_reqs is None:
            return 0
        cap = max(1, math.ceil(pol.max_concurrent_reqs * self.concurrency_share))
        more = min(more, cap - 1)
        n = self._active.get(tenant_id, 0)  # this request's first slot included
        if n + more + self.others_active.get(tenant_id, 0) > cap:
            raise ApiError(429, f"tenant concurrent request limit reached (this request runs {more + 1} sequences)",
                           code="concurrency_limit_exceeded", headers={"Retry-After": "1"})
        self._active[tenant_id] = n + more
        return more

    def release(self, tenant_id: str, slots: int = 1) -> None:
        n = self._active.get(tenant_id)
        if n:
            if n <= slots:
                del self._active[tenant_id]
            else:
                self._active[tenant_id] = n - slots

    def active(self, tenant_id: str) -> int:
        return self._active.get(tenant_id, 0)


def load_jwks_file(path: str | Path) -> dict:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise ValueError(f"jwks file {path}: expected {{\"keys\": [...]}}")
    return data
