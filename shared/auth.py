"""Who is calling, and may they: identities, roles, the route table, and per-job access.

A request carries ``Authorization: Bearer <token>``. The token is either one of ours
(random, issued by ``gpuorch tokens create`` or the API, stored only as its SHA-256
in the KV bucket ``gpuorch_tokens``) or, when an OIDC issuer is configured, a JWT
signed by that issuer (checked with PyJWT against the issuer's JWKS). Either way it
maps to a ``Principal``: a user, groups and a role (``user`` < ``operator`` < ``admin``).

Every route's least role is in ``ROUTE_ROLES``; a route missing there is refused to
everyone (fail closed), and a test checks the table against the app's routes.
Which jobs a user may see or cancel is ``job_access`` (own jobs, and the jobs of the
queues their groups share, per the queue's ``group_access``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fastapi import HTTPException, Request  # module level: FastAPI reads the dependencies' annotations
from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.model import PRIORITY_RANK, JobSpec, QueueSpec

if TYPE_CHECKING:
    from shared.cluster import JobRecord
    from shared.eventlog import EventLog

log = logging.getLogger("gpuorch.auth")

Role = Literal["user", "operator", "admin"]
ROLE_RANK: dict[str, int] = {"user": 0, "operator": 1, "admin": 2}
PUBLIC = "public"
FORWARDED = "forwarded"  # the split gateway's pass-through: the service behind it checks the caller
TOKEN_BUCKET = "gpuorch_tokens"
TOKEN_PREFIX = "gpo_"
NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.@+-]{0,127}$"
_NAME = re.compile(NAME)

# (method, route path) -> the least role that may call it. Docs (/openapi.json, /docs) are plain
# Starlette routes outside this table: they describe the API and reveal nothing of the cluster.
ROUTE_ROLES: dict[tuple[str, str], str] = {
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/readyz"): PUBLIC,
    ("GET", "/v1/whoami"): "user",
    ("GET", "/metrics"): "user",
    # jobs: users see and act on the jobs ``job_access`` allows them
    ("POST", "/v1/jobs"): "user",
    ("GET", "/v1/jobs"): "user",
    ("GET", "/v1/jobs/{job_id}"): "user",
    ("DELETE", "/v1/jobs/{job_id}"): "user",
    ("POST", "/v1/jobs:cancel"): "user",
    ("POST", "/v1/jobs/{job_id}/hold"): "user",
    ("PATCH", "/v1/jobs/{job_id}"): "user",
    ("POST", "/v1/jobs/{job_id}/release"): "user",
    ("GET", "/v1/jobs/{job_id}/logs"): "user",
    ("GET", "/v1/jobs/{job_id}/events"): "user",
    # the cluster, read-only
    ("GET", "/v1/queues"): "user",
    ("GET", "/v1/usage"): "user",
    ("GET", "/v1/nodes"): "user",
    ("GET", "/v1/nodes/{node_id}"): "user",
    # operations
    ("GET", "/v1/events"): "operator",
    ("GET", "/v1/events/stream"): "operator",
    ("GET", "/v1/services"): "operator",
    ("POST", "/v1/nodes/{node_id}/cordon"): "operator",
    ("POST", "/v1/nodes/{node_id}/drain"): "operator",
    ("POST", "/v1/nodes/{node_id}/resume"): "operator",
    ("GET", "/v1/pools"): "operator",
    ("GET", "/v1/deployments"): "operator",
    ("POST", "/v1/deployments/{name}/metrics"): "operator",
    # administration
    ("PUT", "/v1/queues/{path}"): "admin",
    ("DELETE", "/v1/queues/{path}"): "admin",
    ("PUT", "/v1/pools/{name}"): "admin",
    ("PUT", "/v1/deployments/{name}"): "admin",
    ("DELETE", "/v1/pools/{name}"): "admin",
    ("DELETE", "/v1/deployments/{name}"): "admin",
    ("POST", "/v1/nodes/{node_id}/inject-xid"): "admin",
    ("POST", "/v1/tokens"): "admin",
    ("GET", "/v1/tokens"): "admin",
    ("DELETE", "/v1/tokens/{token_id}"): "admin",
    **{(m, "/v1/{rest:path}"): FORWARDED for m in ("GET", "POST", "PUT", "DELETE", "PATCH")},
    # the dashboard (services/dashboard): pages read the API as their caller; the events page needs what
    # /v1/events/stream needs
    ("GET", "/"): "user",
    ("GET", "/ui/queues"): "user",
    ("GET", "/ui/jobs"): "user",
    ("GET", "/ui/jobs/{job_id}"): "user",
    ("GET", "/ui/jobs/{job_id}/logs"): "user",
    ("GET", "/ui/events"): "operator",
    ("GET", "/ui/events/stream"): "operator",
    ("GET", "/ui/static/{name}"): PUBLIC,
    ("GET", "/ui/login"): PUBLIC,
    ("POST", "/ui/login"): PUBLIC,  # checks the token it is given
    ("POST", "/ui/logout"): PUBLIC,
}

# The browser's session: the dashboard's login form keeps the caller's token in this HttpOnly, SameSite=Strict
# cookie, taken in place of the Authorization header on these GET routes only (reads: a forged cross-site
# request can change nothing, and the API's own routes never take the cookie).
SESSION_COOKIE = "gpuorch_session"
COOKIE_ROUTES: frozenset[tuple[str, str]] = frozenset(
    (m, p) for (m, p), need in ROUTE_ROLES.items() if m == "GET" and (p == "/" or p.startswith("/ui/")) and need != PUBLIC)


class Unauthenticated(Exception):
    """No credentials, or credentials we cannot accept (401)."""


@dataclass(frozen=True, slots=True)
class Principal:
    user: str
    groups: tuple[str, ...] = ()
    role: str = "user"
    via: str = "token"  # token | oidc

    def at_least(self, role: str) -> bool:
        return role == PUBLIC or ROLE_RANK[self.role] >= ROLE_RANK[role]


# --- tokens ------------------------------------------------------------------------------


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenRecord(BaseModel):
    """What a token stands for; stored under the SHA-256 of the token (the token itself is never stored)."""

    model_config = ConfigDict(extra="forbid")
    id: str  # the first 12 hex digits of the hash: names the token in lists and revocations
    user: str
    groups: tuple[str, ...] = ()
    role: Role = "user"
    name: str = Field("", max_length=200)
    created_at: float = 0.0
    expires_at: float | None = None

    @field_validator("user")
    @classmethod
    def _user(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("user: letters, digits and _ . @ + -, at most 128")
        return v

    @field_validator("groups")
    @classmethod
    def _groups(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(v) > 64 or not all(_NAME.match(g) for g in v):
            raise ValueError("groups: at most 64 names of letters, digits and _ . @ + -")
        return tuple(sorted(set(v)))

    def principal(self) -> Principal:
        return Principal(self.user, self.groups, self.role, "token")


class TokenStore:
    """Tokens in the KV bucket ``gpuorch_tokens``, shared by every API process; a short cache per process.

    A revoked token stops working within ``CACHE_S`` on every process.
    """

    CACHE_S = 5.0

    def __init__(self, evlog: "EventLog") -> None:
        self.evlog = evlog
        self._kv: Any = None
        self._cache: dict[str, tuple[float, TokenRecord | None]] = {}

    async def kv(self) -> Any:
        if self._kv is None:
            self._kv = await self.evlog.kv(TOKEN_BUCKET)
        return self._kv

    async def lookup(self, token: str, now: float | None = None) -> TokenRecord | None:
        now = time.time() if now is None else now
        key = token_hash(token)
        hit = self._cache.get(key)
        if hit is None or hit[0] < now:
            rec = await self._get(key)
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[key] = (now + (self.CACHE_S if rec else 0.5), rec)
            hit = self._cache[key]
        rec = hit[1]
        if rec is None or (rec.expires_at is not None and rec.expires_at <= now):
            return None
        return rec

    async def _get(self, key: str) -> TokenRecord | None:
        from nats.js.errors import KeyDeletedError, KeyNotFoundError

        try:
            entry = await (await self.kv()).get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if not entry.value:
            return None
        try:
            return TokenRecord.model_validate_json(entry.value)
        except ValueError:
            log.warning("event=token_record_unreadable key=%s", key[:12])
            return None

    async def put(self, token: str, user: str, groups: tuple[str, ...] | list[str], role: str, *,
                  name: str = "", expires_at: float | None = None) -> TokenRecord:
        key = token_hash(token)
        rec = TokenRecord(id=key[:12], user=user, groups=tuple(groups), role=role, name=name,  # type: ignore[arg-type]
                          created_at=time.time(), expires_at=expires_at)
        await (await self.kv()).put(key, rec.model_dump_json().encode())
        self._cache.pop(key, None)
        return rec

    async def create(self, user: str, groups: tuple[str, ...] | list[str], role: str, *, name: str = "",
                     expires_at: float | None = None) -> tuple[str, TokenRecord]:
        token = new_token()
        return token, await self.put(token, user, groups, role, name=name, expires_at=expires_at)

    async def records(self) -> list[tuple[str, TokenRecord]]:
        # the keys from the bucket stream's per-subject counts, in one request: nats-py's kv.keys() ends its listing
        # when a consumer_info read says nothing is pending, which it also says of messages already delivered but not
        # yet handed over, and then lists none (20 lists of 300 missed the token just made)
        await self.kv()
        prefix = f"$KV.{TOKEN_BUCKET}."
        info = await self.evlog.js.stream_info(f"KV_{TOKEN_BUCKET}", subjects_filter=prefix + ">")
        out = []
        for key in (subject[len(prefix):] for subject in info.state.subjects or {}):
            if rec := await self._get(key):  # None: deleted (revoked)
                out.append((key, rec))
        return sorted(out, key=lambda kr: kr[1].created_at)

    async def revoke(self, token_id: str) -> TokenRecord | None:
        for key, rec in await self.records():
            if rec.id == token_id:
                await (await self.kv()).delete(key)
                self._cache.pop(key, None)
                return rec
        return None


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


async def ensure_admin_token(store: TokenStore, path: Path, token: str | None = None) -> str:
    """The bootstrap admin token: ``token`` if given (GPUORCH_ADMIN_TOKEN), else the one kept at ``path``
    (created on first start, mode 0600, like a kubeconfig); registered in the store either way."""
    if token is not None and (not token.startswith(TOKEN_PREFIX) or len(token) < len(TOKEN_PREFIX) + 32):
        raise SystemExit(f"error: GPUORCH_ADMIN_TOKEN must be {TOKEN_PREFIX} followed by at least 32 random characters")
    if token is None:
        try:
            token = path.read_text().strip() or None
        except FileNotFoundError:
            token = None
    if token is None:
        token = new_token()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(".tmp")
        tmp.touch(mode=0o600)
        tmp.write_text(token + "\n")
        tmp.replace(path)
    if await store.lookup(token) is None:
        await store.put(token, "admin", ("admins",), "admin", name="bootstrap admin")
    return token


# --- OIDC ------------------------------------------------------------------------------


class OidcVerifier:
    """JWTs from one OIDC issuer, checked by PyJWT against the issuer's published keys (JWKS).

    The user is the ``user_claim`` (default ``preferred_username``, else ``sub``), the groups the
    ``groups_claim``; the role is the ``role_claim`` when it names one, else ``admin``/``operator``
    when a group is listed in ``admin_groups``/``operator_groups``, else ``user``.
    """

    ALGORITHMS = ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "EdDSA"]

    def __init__(self, issuer: str, audience: str, jwks_url: str | None = None, *, user_claim: str = "preferred_username",
                 groups_claim: str = "groups", role_claim: str = "gpuorch_role",
                 admin_groups: tuple[str, ...] = (), operator_groups: tuple[str, ...] = ()) -> None:
        self.issuer, self.audience, self.jwks_url = issuer, audience, jwks_url
        self.user_claim, self.groups_claim, self.role_claim = user_claim, groups_claim, role_claim
        self.admin_groups, self.operator_groups = set(admin_groups), set(operator_groups)
        self._client: Any = None

    def _jwks(self) -> Any:
        import httpx
        import jwt

        if self._client is None:
            url = self.jwks_url
            if url is None:
                conf = httpx.get(self.issuer.rstrip("/") + "/.well-known/openid-configuration", timeout=10).json()
                url = conf["jwks_uri"]
            self._client = jwt.PyJWKClient(url, cache_keys=True, lifespan=300, timeout=10)
        return self._client

    def verify(self, token: str) -> Principal:
        """Blocking (it may fetch the JWKS): call it in a thread."""
        import jwt

        try:
            key = self._jwks().get_signing_key_from_jwt(token)
            claims = jwt.decode(token, key.key, algorithms=self.ALGORITHMS, audience=self.audience, issuer=self.issuer,
                                leeway=30, options={"require": ["exp", "iss", "aud"]})
        except (jwt.PyJWTError, KeyError, ValueError, OSError) as e:
            raise Unauthenticated(f"invalid OIDC token: {e}") from None
        user = claims.get(self.user_claim) or claims.get("sub")
        groups = claims.get(self.groups_claim) or []
        if not isinstance(user, str) or not _NAME.match(user):
            raise Unauthenticated(f"OIDC token has no usable {self.user_claim!r} or 'sub' claim")
        if not isinstance(groups, list) or not all(isinstance(g, str) and _NAME.match(g) for g in groups):
            raise Unauthenticated(f"OIDC token's {self.groups_claim!r} claim is not a list of group names")
        role = claims.get(self.role_claim)
        if role not in ROLE_RANK:
            role = ("admin" if self.admin_groups & set(groups) else
                    "operator" if self.operator_groups & set(groups) else "user")
        return Principal(user, tuple(sorted(set(groups))), role, "oidc")


# --- the HTTP edge ---------------------------------------------------------------------


class Authenticator:
    """Bearer token -> Principal: our tokens first, then (for a JWT) the OIDC issuer if one is configured."""

    def __init__(self, tokens: TokenStore, oidc: OidcVerifier | None = None) -> None:
        self.tokens, self.oidc = tokens, oidc

    async def principal(self, authorization: str | None) -> Principal:
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("authentication required: send 'Authorization: Bearer <token>' "
                                  "(the admin token of `gpuorch up` is in <data-dir>/auth/admin.token)")
        if len(token) > 8192:
            raise Unauthenticated("token too long")
        if token.startswith(TOKEN_PREFIX):
            rec = await self.tokens.lookup(token)
            if rec is None:
                raise Unauthenticated("unknown, revoked or expired token")
            return rec.principal()
        if self.oidc is not None and token.count(".") == 2:
            return await asyncio.to_thread(self.oidc.verify, token)
        raise Unauthenticated("unknown token" + ("" if self.oidc else " (no OIDC issuer is configured)"))


def authenticator_from_settings(settings: Any, evlog: "EventLog") -> Authenticator:
    oidc = None
    if settings.oidc_issuer:
        if not settings.oidc_audience:
            raise SystemExit("error: GPUORCH_OIDC_ISSUER needs GPUORCH_OIDC_AUDIENCE (the client id tokens are issued for)")
        oidc = OidcVerifier(settings.oidc_issuer, settings.oidc_audience, settings.oidc_jwks_url,
                            user_claim=settings.oidc_user_claim, groups_claim=settings.oidc_groups_claim,
                            role_claim=settings.oidc_role_claim, admin_groups=tuple(settings.oidc_admin_groups),
                            operator_groups=tuple(settings.oidc_operator_groups))
    return Authenticator(TokenStore(evlog), oidc)


async def authorize(request: Request) -> None:
    """The app-wide dependency: the route's least role from ROUTE_ROLES, the caller's identity, 401/403."""
    route = request.scope.get("route")
    path = getattr(route, "path", request.url.path)
    need = ROUTE_ROLES.get((request.method, path))
    if need is None:
        raise HTTPException(403, f"{request.method} {path} is not in the role table: refused to everyone")
    if need in (PUBLIC, FORWARDED):
        return
    auth: Authenticator | None = request.app.state.auth
    if auth is None:
        raise HTTPException(403, f"{request.method} {path} is not served by this process")
    authorization = request.headers.get("authorization")
    if authorization is None and (request.method, path) in COOKIE_ROUTES and request.cookies.get(SESSION_COOKIE):
        authorization = f"Bearer {request.cookies[SESSION_COOKIE]}"
    try:
        principal = await auth.principal(authorization)
    except Unauthenticated as e:
        raise HTTPException(401, str(e), headers={"WWW-Authenticate": 'Bearer realm="gpuorch"'}) from None
    if not principal.at_least(need):
        raise HTTPException(403, f"{request.method} {path} needs the {need} role; {principal.user} is {principal.role}")
    request.state.principal = principal


async def caller(request: Request) -> Principal:
    """The authenticated caller of this request (set by ``authorize``). Async: FastAPI runs a plain ``def``
    dependency in its thread pool, a thread handoff (and a wait for the GIL) for every request."""
    principal = getattr(request.state, "principal", None)
    if principal is None:
        raise HTTPException(401, "authentication required", headers={"WWW-Authenticate": 'Bearer realm="gpuorch"'})
    return principal


# --- which queues and jobs a user may touch --------------------------------------------


def queue_groups(queues: dict[str, QueueSpec], path: str) -> tuple[str, ...]:
    """The groups admitted to a queue: its own, else its nearest ancestor's that names any (empty: everyone)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        spec = queues.get(".".join(parts[:i]))
        if spec is not None and spec.groups:
            return spec.groups
    return ()


def submit_error(p: Principal, queues: dict[str, QueueSpec], spec: JobSpec) -> str | None:
    """Why this caller may not submit this job to its queue (None: it may). Admins may submit anywhere."""
    if p.role == "admin":
        return None
    groups = queue_groups(queues, spec.queue)
    if groups and not set(groups) & set(p.groups):
        return f"queue {spec.queue} admits the groups {', '.join(groups)}; {p.user} is in {', '.join(p.groups) or 'none'}"
    q = queues.get(spec.queue)
    cap = q.max_priority if q is not None else "high"
    if PRIORITY_RANK[spec.priority] > PRIORITY_RANK[cap]:
        return f"queue {spec.queue} takes users' jobs up to priority {cap}, not {spec.priority} (ask an operator)"
    return None


def job_access(p: Principal, job: "JobRecord", queues: dict[str, QueueSpec]) -> str:
    """'cancel', 'read' or 'none': admins everything; operators read all and cancel their own; users their own
    jobs, and the jobs of a queue their groups share as that queue's ``group_access`` says."""
    if p.role == "admin" or (job.owner and job.owner == p.user):
        return "cancel"
    if p.role == "operator":
        return "read"
    q = queues.get(job.spec.queue)
    if q is not None and q.group_access != "none" and set(queue_groups(queues, job.spec.queue)) & set(p.groups):
        return q.group_access
    return "none"


class RateLimiter:
    """A token bucket per key: ``rate`` per second, up to ``burst`` at once. Pure: the caller passes ``now``."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def take(self, key: str, now: float, n: int = 1) -> float:
        """0 if ``n`` may pass now (and takes them), else the seconds until they could."""
        tokens, at = self._buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        if tokens >= n:
            self._buckets[key] = (tokens - n, now)
            return 0.0
        self._buckets[key] = (tokens, now)
        return (n - tokens) / self.rate if self.rate > 0 else float("inf")
