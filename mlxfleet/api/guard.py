"""API keys, per-client rate limits and request ids for the gateway."""

from __future__ import annotations

import hmac
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from typing import Optional

from quart import Quart, g, request
from quart.wrappers.response import DataBody

from ..fleet_auth import (
    AUTH_HEADER,
    CLIENT_AUTH,
    FORWARDED_HEADER,
    FleetAuthError,
    Signed,
    Verifier,
    sign_answer,
)
from ..fleet_tls import JOIN_ROUTE, SCOPE_NODE
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
    """A sliding one-minute window per client, for the ``max_clients`` seen most
    recently (the least recent is forgotten: O(1) per request, however many addresses
    a flood comes from; scanning the table made 16,000 addresses 4.5x slower)."""

    def __init__(self, per_minute: int, max_clients: int = 4096):
        self.per_minute, self.max_clients = per_minute, max_clients
        self._hits: OrderedDict[str, deque] = OrderedDict()

    def check(self, client: str) -> Optional[int]:
        """None if allowed, else seconds until the client may retry."""
        now = time.monotonic()
        q = self._hits.get(client)
        if q is None:
            q = self._hits[client] = deque()
            if len(self._hits) > self.max_clients:
                self._hits.popitem(last=False)
        else:
            self._hits.move_to_end(client)
        while q and now - q[0] >= 60:
            q.popleft()
        if len(q) >= self.per_minute:
            return max(1, int(60 - (now - q[0])) + 1)
        q.append(now)
        return None


CONTROL_PREFIX = "/mlxfleet/v1/"
_WRITES = ("POST", "PUT", "PATCH", "DELETE")
#: Ollama's routes that change what is on disk: control writes (the admin key), though
#: they take Ollama's bodies as its clients and ``curl -d`` send them.
STORE_WRITES = frozenset({"/api/pull", "/api/delete", "/api/copy", "/api/create",
                          "/api/push"})
#: Bodies the control API's writes take: none of them is one a page may send cross-origin
#: without a CORS preflight (which this server never grants).
_CONTROL_TYPES = ("application/json", "application/yaml", "application/x-yaml", "text/yaml",
                  "text/x-yaml")
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def allowed_hosts(bind: str, configured: list[str]) -> Optional[frozenset[str]]:
    """The ``Host`` names the gateway answers to, or None for any. A loopback or
    specific bind answers to its own address, loopback names and the configured ones
    (a page on a rebound DNS name never gets an answer); a wildcard bind (which needs
    an API key) answers to any name unless some are configured."""
    if "*" in configured:
        return None
    names = {h.lower().strip("[]") for h in configured}
    if bind in ("0.0.0.0", "::", "") and not names:
        return None
    return frozenset(names | _LOOPBACK_NAMES | {bind.lower().strip("[]")})


def host_name(host: str) -> str:
    """``Host`` header -> the name without the port (``[::1]:8000`` -> ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def cross_origin(headers: Mapping[str, str]) -> Optional[str]:
    """The origin of a browser request sent from another site's page, else None.
    Browsers send ``Sec-Fetch-Site`` (modern ones) and ``Origin`` on every POST; tools
    such as curl and the SDKs send neither."""
    origin = headers.get("origin")
    site = (headers.get("sec-fetch-site") or "").lower()
    if site in ("cross-site", "same-site"):
        return origin or site
    if origin is None or site in ("same-origin", "none"):
        return None
    if origin == "null":  # sandboxed frames, file:// pages
        return origin
    from urllib.parse import urlsplit

    try:
        netloc = urlsplit(origin).netloc.lower()
    except ValueError:
        return origin
    return None if netloc == (headers.get("host") or "").lower() else origin


class Guard:
    """Client keys for inference and reads; admin keys (default: the client keys) for
    control-API writes, which without any key are accepted from loopback only. In a
    fleet, other nodes sign their requests with the fleet key instead (they checked
    their client's key): ``fleet_auth``.

    Framework-free: the Quart routes and the gateway's lean model routes both call it."""

    def __init__(self, api_keys: list[str], rate_limit: int,
                 admin_keys: Optional[list[str]] = None, fleet_key: Optional[str] = None,
                 fleet: bool = False, hosts: Optional[frozenset[str]] = None,
                 more_hosts: Callable[[], Iterable[str]] = tuple,
                 origins: Iterable[str] = (), node_tls: bool = False):
        self.api_keys, self.fleet_key, self.fleet = api_keys, fleet_key, fleet
        # this node joined a fleet with TLS: nodes reach it on the node listener only,
        # with a certificate of the fleet CA that names the node that signed the request
        self.node_tls = node_tls
        self.verifier = Verifier(fleet_key) if fleet_key else None
        self.hosts, self.more_hosts = hosts, more_hosts
        self.origins = [o.rstrip("/").lower() for o in origins]
        self.limiter = RateLimiter(rate_limit) if rate_limit > 0 else None
        self.admin_keys = admin_keys or []
        self.any_key = api_keys + [k for k in self.admin_keys if k not in api_keys]

    def check(self, path: str, method: str, headers: Mapping[str, str],
              remote_addr: str, target: str = "", node_cert: Optional[str] = None
              ) -> Optional[Signed]:
        """Raise the APIError that refuses this request, if any. Returns who sent it
        when another node of the fleet did (``target``: the path and query as sent,
        which its signature covers; ``node_cert``: the node named by the client's
        certificate, on the TLS node listener), else None."""
        if path in OPEN_ROUTES:
            return None  # liveness and metrics
        self._check_host(headers)
        if path == "/" or path.startswith("/ui/"):
            return None  # the dashboard's static files
        if method in _WRITES:
            self._check_origin(headers, path.startswith(CONTROL_PREFIX)
                               or path in STORE_WRITES)
        if path == JOIN_ROUTE and self.fleet and node_cert is None:
            self._limit(f"addr:{remote_addr}")  # the join token is its credential
            return None
        sender = self._from_node(headers, remote_addr, method, target or path) \
            if self.fleet else None
        if self.node_tls or node_cert is not None:
            self._check_node_tls(sender, node_cert)
        if sender is not None and self.fleet_key:
            # another node, proven by the key: it admitted the client already, and may
            # forward and poll; changing models still takes an admin key (its client's)
            if self.admin_keys and ((path.startswith(CONTROL_PREFIX) and method in _WRITES)
                                    or path in STORE_WRITES) \
                    and not key_ok(presented_key(headers), self.admin_keys):
                raise APIError(403, "A node of the fleet may forward requests and poll; "
                               "changing models needs the admin key (MLXFLEET_ADMIN_KEY).",
                               type="permission_error", code="admin_key_required")
            return sender
        if path == NODE_ROUTE or path.startswith(PEER_ROUTE):
            if not self.fleet:  # a single machine serves its weights to nobody
                raise APIError(404, "Not found: this server is not a node of a fleet.",
                               type="not_found_error", code="not_found")
            if sender is None:
                raise APIError(401, "This route is for the other nodes of the fleet: sign "
                               "the request with the fleet key.", type="authentication_error",
                               code="invalid_fleet_key")
        key = presented_key(headers)
        if self.api_keys and not key_ok(key, self.any_key):  # inference and reads
            raise APIError(401, "Invalid or missing API key. Send it as 'Authorization: "
                           "Bearer KEY' or 'x-api-key: KEY'.", type="authentication_error",
                           code="invalid_api_key",
                           headers={"WWW-Authenticate": 'Bearer realm="mlxfleet"'})
        _check_encoding(headers)
        # Every route that costs work counts (inference on /v1 and Ollama's /api, the
        # store, control writes); reads of the control API's status (what the dashboard
        # and the CLI poll, from memory) do not. Without a fleet key anyone on this
        # machine can claim to be a node: such a request is still only forwarded once,
        # but it is rate limited like any other.
        if method in _WRITES or not path.startswith(CONTROL_PREFIX):
            self._limit(f"key:{key}" if key and self.api_keys else f"addr:{remote_addr}")
        if path.startswith(CONTROL_PREFIX) and method in _WRITES:
            self._control_write(key, remote_addr)
            self._check_content_type(headers)
        elif path in STORE_WRITES:
            self._control_write(key, remote_addr)
        return sender

    def _limit(self, client: str) -> None:
        if self.limiter is None:
            return
        wait = self.limiter.check(client)
        if wait is not None:
            raise APIError(429, f"Rate limit of {self.limiter.per_minute} requests per "
                           "minute exceeded; retry later.", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(wait)})

    def _check_node_tls(self, sender: Optional[Signed], node_cert: Optional[str]) -> None:
        """In a fleet with TLS: requests of nodes come over the node listener, signed by
        the node their certificate names; that listener answers nothing else."""
        if node_cert is not None and sender is None:
            raise APIError(401, "This port answers the nodes of the fleet only (signed "
                           "requests); clients use the gateway's port.",
                           type="authentication_error", code="invalid_fleet_key")
        if sender is None:
            return
        if node_cert is None:
            raise APIError(401, "In this fleet, nodes reach each other over TLS on the node "
                           "port (the https url of their Node manifest), not this one.",
                           type="authentication_error", code="fleet_tls_required")
        if sender.sender != node_cert:
            raise APIError(401, f"The request says it comes from node {sender.sender!r}, but "
                           f"its TLS certificate names node {node_cert!r}.",
                           type="authentication_error", code="invalid_fleet_key")

    def may_unload(self, headers: Mapping[str, str], sender: Optional[Signed]) -> bool:
        """Whether this request may shorten a model's keep-alive or unload it: anyone
        when no key is configured (Ollama's semantics), else admin keys only (a node
        that forwards a request has applied this rule already)."""
        if not self.api_keys or (sender is not None and self.fleet_key):
            return True
        return key_ok(presented_key(headers), self.admin_keys)

    def _check_host(self, headers: Mapping[str, str]) -> None:
        """Answer only to this server's own names: a page whose DNS name was rebound to
        127.0.0.1 is same-origin for the browser, but its Host header gives it away."""
        if self.hosts is None:
            return
        name = host_name(headers.get("host") or "")
        if name in self.hosts or name in self.more_hosts():
            return
        raise APIError(403, f"Host {name!r} is not a name of this server; add it to the "
                       "allowed_hosts setting (MLXFLEET_ALLOWED_HOSTS) if it is.",
                       type="permission_error", code="host_not_allowed")

    def _check_origin(self, headers: Mapping[str, str], control: bool) -> None:
        """Refuse writes sent by another site's page (CSRF: a form or a no-cors fetch
        needs no preflight); control writes only take content types that need one.
        Origins in ``allowed_origins`` may infer (as Ollama's OLLAMA_ORIGINS), and so may
        apps and editors' webviews (``app://``, ``vscode-webview://``, extensions: not
        web pages); only the dashboard itself changes models."""
        origin = cross_origin(headers)
        if origin is None:
            return
        scheme = origin.split(":", 1)[0].lower()
        if not control and (scheme not in ("http", "https", "null", "same-site", "cross-site")
                            or "*" in self.origins or origin.rstrip("/").lower()
                            in self.origins):
            return
        raise APIError(403, f"Cross-origin request from {origin} refused: pages of other "
                       "sites may not use this server (allowed_origins lets a web page "
                       "you trust infer).", type="permission_error", code="cross_origin")

    @staticmethod
    def _check_content_type(headers: Mapping[str, str]) -> None:
        ctype = (headers.get("content-type") or "").split(";")[0].strip().lower()
        has_body = headers.get("content-length", "0") not in ("", "0") \
            or "transfer-encoding" in headers
        if (has_body or ctype) and ctype not in _CONTROL_TYPES:
            raise APIError(415, f"Content-Type {ctype or 'none'!r} is not accepted here: send "
                           "application/json or application/yaml.",
                           code="unsupported_media_type")

    def _from_node(self, headers: Mapping[str, str], remote_addr: str, method: str,
                   target: str) -> Optional[Signed]:
        """Who sent this request when another node did: it says so, and signed it with
        the fleet key when one is set (a bad or missing signature is a 401, never a
        silent downgrade)."""
        sender = headers.get(FORWARDED_HEADER.lower())
        signature = headers.get(AUTH_HEADER.lower())
        if sender is None and signature is None:
            return None
        if self.verifier is not None:
            try:
                return self.verifier.check(headers, method, target)
            except FleetAuthError as e:
                raise APIError(401, f"Not a node of this fleet: {e}. Nodes of a fleet must "
                               "share MLXFLEET_FLEET_KEY.", type="authentication_error",
                               code="invalid_fleet_key") from None
        if not is_loopback(remote_addr):
            return None  # no key: only nodes on this machine are taken at their word
        return Signed(request_id(sender) if sender else "", "", "")

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
        key = presented_key(request.headers)
        CLIENT_AUTH.set(f"Bearer {key}" if key else None)  # (passed on to another node)
        sender = guard.check(request.path, request.method, request.headers,
                             request.remote_addr or "", target_of(request.scope),
                             request.scope.get(SCOPE_NODE))
        if sender is not None:
            if guard.verifier is not None and not sender.body_ok(await request.get_data()):
                raise APIError(401, "The body does not match its fleet signature.",
                               type="authentication_error", code="invalid_fleet_key")
            g.forwarded_by = sender if sender.sender else None

    @app.after_request
    async def _request_id(response):
        response.headers["X-Request-Id"] = getattr(g, "request_id", "")
        signed = getattr(g, "forwarded_by", None)
        if signed is not None and guard.fleet_key and isinstance(response.response, DataBody):
            # another node takes this answer at its word (a report, a listing, a stored
            # response): it is signed over that request's nonce
            response.headers[AUTH_HEADER] = sign_answer(
                guard.fleet_key, signed.nonce, response.status_code,
                await response.get_data())
        return response


NODE_ROUTE = "/mlxfleet/v1/node"
PEER_ROUTE = "/mlxfleet/v1/store/"  # peer copy: what a node holds, served to the others


def _check_encoding(headers: Mapping[str, str]) -> None:
    """Bodies come as they are or chunked: a compressed one would be taken as JSON
    garbage (``Transfer-Encoding: gzip, chunked`` was accepted, the gzip ignored)."""
    te = [t.strip().lower() for t in (headers.get("transfer-encoding") or "").split(",")]
    if any(t not in ("", "chunked") for t in te):
        raise APIError(501, f"Transfer-Encoding {headers.get('transfer-encoding')!r} is not "
                       "supported: send the body as it is, or chunked.",
                       type="server_error", code="unsupported_transfer_encoding")
    ce = (headers.get("content-encoding") or "").strip().lower()
    if ce not in ("", "identity"):
        raise APIError(415, f"Content-Encoding {ce!r} is not supported: send the body "
                       "uncompressed.", code="unsupported_media_type")


def target_of(scope: Mapping) -> str:
    """The request's path and query as sent (what a fleet signature covers)."""
    raw = scope.get("raw_path") or scope.get("path", "").encode()
    qs = scope.get("query_string") or b""
    return (raw + (b"?" + qs if qs else b"")).decode("latin-1")


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
