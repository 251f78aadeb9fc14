"""API keys, per-client rate limits and request ids for the gateway."""

from __future__ import annotations

import hmac
import time
import uuid
from collections import deque
from collections.abc import Mapping
from typing import Optional

from quart import Quart, g, request

from ..wire import APIError

#: Routes anyone may call: liveness for load balancers; /metrics is opt-in and documented
#: as unauthenticated (keep it behind a firewall or proxy).
OPEN_ROUTES = ("/health", "/metrics")


def presented_key(headers: Mapping[str, str]) -> Optional[str]:
    """The key from ``Authorization: Bearer`` or Anthropic's ``x-api-key``."""
    auth = headers.get("authorization") or ""
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return headers.get("x-api-key")


def key_ok(given: Optional[str], keys: list[str]) -> bool:
    if given is None:
        return False
    ok = False
    for k in keys:  # compare with every key, in constant time, so timing reveals nothing
        ok |= hmac.compare_digest(given.encode(), k.encode())
    return ok


class RateLimiter:
    """A sliding one-minute window per client."""

    def __init__(self, per_minute: int):
        self.per_minute = per_minute
        self._hits: dict[str, deque] = {}

    def check(self, client: str) -> Optional[int]:
        """None if allowed, else seconds until the client may retry."""
        now = time.monotonic()
        q = self._hits.setdefault(client, deque())
        while q and now - q[0] >= 60:
            q.popleft()
        if len(q) >= self.per_minute:
            return max(1, int(60 - (now - q[0])) + 1)
        q.append(now)
        if len(self._hits) > 10_000:  # forget idle clients
            for c in [c for c, d in self._hits.items() if not d]:
                del self._hits[c]
        return None


CONTROL_PREFIX = "/mlxfleet/v1/"
_WRITES = ("POST", "PUT", "PATCH", "DELETE")


class Guard:
    """Client keys for inference and reads; admin keys (default: the client keys) for
    control-API writes, which without any key are accepted from loopback only. In a
    fleet, other nodes present the fleet key instead (they checked their client's key).

    Framework-free: the Quart routes and the gateway's lean model routes both call it."""

    def __init__(self, api_keys: list[str], rate_limit: int,
                 admin_keys: Optional[list[str]] = None, fleet_key: Optional[str] = None,
                 fleet: bool = False):
        self.api_keys, self.fleet_key, self.fleet = api_keys, fleet_key, fleet
        self.limiter = RateLimiter(rate_limit) if rate_limit > 0 else None
        self.admin_keys = admin_keys or []
        self.any_key = api_keys + [k for k in self.admin_keys if k not in api_keys]

    def check(self, path: str, method: str, headers: Mapping[str, str],
              remote_addr: str) -> Optional[str]:
        """Raise the APIError that refuses this request, if any. Returns the forwarding
        node's name when another node of the fleet sent it, else None."""
        if path in OPEN_ROUTES or path == "/" or path.startswith("/ui/"):
            return None  # liveness, metrics and the dashboard's static files
        if self.fleet:
            sender = self._from_node(headers, remote_addr)
            if sender is not None:
                return sender  # another node of the fleet: it admitted the client already
        if path == NODE_ROUTE and self.fleet_key:
            raise APIError(401, "This route is for the other nodes of the fleet: send the "
                           "fleet key in X-Mlxfleet-Fleet-Key.", type="authentication_error",
                           code="invalid_fleet_key")
        key = presented_key(headers)
        if self.api_keys and not key_ok(key, self.any_key):  # inference and reads
            raise APIError(401, "Invalid or missing API key. Send it as 'Authorization: "
                           "Bearer KEY' or 'x-api-key: KEY'.", type="authentication_error",
                           code="invalid_api_key",
                           headers={"WWW-Authenticate": 'Bearer realm="mlxfleet"'})
        if path.startswith(CONTROL_PREFIX) and method in _WRITES:
            self._control_write(key, remote_addr)
            return None
        if self.limiter and path.startswith("/v1/"):
            client = f"key:{key}" if key and self.api_keys else f"addr:{remote_addr}"
            wait = self.limiter.check(client)
            if wait is not None:
                raise APIError(429, f"Rate limit of {self.limiter.per_minute} requests per "
                               "minute exceeded; retry later.", type="rate_limit_error",
                               code="rate_limit_exceeded", headers={"Retry-After": str(wait)})
        return None

    def _from_node(self, headers: Mapping[str, str], remote_addr: str) -> Optional[str]:
        """The sending node when another node sent this request: it says so, and carries
        the fleet key when one is set (a wrong or missing key is a 401, never a silent
        downgrade)."""
        from ..supervisor.fleet import FLEET_KEY_HEADER, FORWARDED_HEADER

        sender = headers.get(FORWARDED_HEADER.lower())
        given = headers.get(FLEET_KEY_HEADER.lower())
        if sender is None and given is None:
            return None
        if self.fleet_key and not key_ok(given, [self.fleet_key]):
            raise APIError(401, "Invalid or missing fleet key (X-Mlxfleet-Fleet-Key): nodes "
                           "of a fleet must share MLXFLEET_FLEET_KEY.",
                           type="authentication_error", code="invalid_fleet_key")
        if not self.fleet_key and not is_loopback(remote_addr):
            return None  # no key: only nodes on this machine are taken at their word
        return request_id(sender) if sender else ""

    def _control_write(self, key: Optional[str], remote_addr: str) -> None:
        """Changing the fleet (apply, delete, load, unload) needs an admin key; with no key
        configured at all, only a client on this machine may."""
        if self.admin_keys:
            if key_ok(key, self.admin_keys):
                return
            raise APIError(403, "Changing models needs the admin key (MLXFLEET_ADMIN_KEY); "
                           "client keys may only read and infer.", type="permission_error",
                           code="admin_key_required")
        if not is_loopback(remote_addr):
            raise APIError(403, "Without an admin key, models can only be changed from this "
                           "machine (set MLXFLEET_ADMIN_KEY to allow it remotely).",
                           type="permission_error", code="admin_key_required")


def install_guard(app: Quart, guard: Guard) -> None:
    """The guard on every Quart route, and the request id on every answer."""

    @app.before_request
    async def _guard():
        g.request_id = request_id(request.headers.get("X-Request-Id"))
        g.started = time.perf_counter()
        sender = guard.check(request.path, request.method, request.headers,
                             request.remote_addr or "")
        if sender is not None:
            g.forwarded_by = sender or None

    @app.after_request
    async def _request_id(response):
        response.headers["X-Request-Id"] = getattr(g, "request_id", "")
        return response


NODE_ROUTE = "/mlxfleet/v1/node"


def request_id(given: Optional[str]) -> str:
    """The client's X-Request-Id when it is a sane header value (printable ASCII, at most
    128 characters), else a fresh one."""
    if given and len(given) <= 128 and given.isascii() and given.isprintable():
        return given
    return uuid.uuid4().hex


def is_loopback(host: str) -> bool:
    import ipaddress

    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
