"""Messages between the nodes of a fleet, signed with the fleet key.

The key itself never crosses the wire: every request one node sends another carries
an HMAC-SHA256 of its method, target (path and query), sending node, a timestamp, a
nonce and the SHA-256 of its body (``X-Mlxfleet-Auth``). The receiver checks the
signature, refuses a timestamp more than ``SKEW`` seconds off and a nonce it has seen
(a replayed request), and checks the body against its digest once it has read it.
Answers that one node takes at its word (its report, a store listing, a stored
response) are signed back over the request's nonce, the status and the body, so
neither a process at a node's address nor anyone on the path can forge them.

Hand-written rather than a library's (HTTP message signatures, RFC 9421, have no
well-kept Python implementation for both httpx and ASGI): 60 lines of ``hmac``.
A leaf: the gateway's guard, the fleet's client and the store import it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Optional

AUTH_HEADER = "X-Mlxfleet-Auth"
#: Set on requests one node forwards to another: who sent it.
FORWARDED_HEADER = "X-Mlxfleet-Forwarded-By"
#: How many nodes a request has been forwarded by. While two nodes' placements disagree
#: (a node just came or went; a one-way partition), the receiver passes a request on to
#: the node it sees holding the model, once, never back to its sender: no loops.
HOPS_HEADER = "X-Mlxfleet-Hops"
MAX_HOPS = 2
#: On a node's ``model_moved`` refusal of a forwarded request: it did nothing with it, so
#: the sender may look the model up again and resend it.
MOVED_HEADER = "x-mlxfleet-moved"
#: Seconds a signed request's timestamp may differ from this node's clock.
SKEW = 120
_NONCES = 200_000  # remembered within SKEW: a replay is refused


#: The client's credentials on the request being served (its ``Authorization``), which a
#: node passes along when it asks another node to change a model for that client: the
#: fleet key lets a node forward and poll, never change models without an admin key.
CLIENT_AUTH: ContextVar[Optional[str]] = ContextVar("mlxfleet_client_auth", default=None)


def hops_of(headers: Mapping[str, str]) -> int:
    """How many nodes have forwarded a request that came from a node: one at least (a
    missing or malformed count is taken as one, so it can go on once at most)."""
    value = headers.get(HOPS_HEADER.lower()) or headers.get(HOPS_HEADER) or ""
    return max(1, int(value)) if value.isdigit() and len(value) < 4 else 1


class FleetAuthError(ValueError):
    """A request or answer that does not carry a valid fleet signature."""


def digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _mac(key: str, *parts: str) -> str:
    return hmac.new(key.encode(), "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def sign(key: str, sender: str, method: str, target: str, body: bytes = b"") -> dict[str, str]:
    """The headers that prove ``sender`` (a holder of ``key``) sent this request."""
    t, n, b = str(int(time.time())), secrets.token_hex(12), digest(body)
    mac = _mac(key, "request", sender, method.upper(), target, t, n, b)
    return {FORWARDED_HEADER: sender, AUTH_HEADER: f"v1 t={t} n={n} b={b} s={mac}"}


def _fields(value: str) -> dict[str, str]:
    head, _, rest = value.partition(" ")
    if head != "v1":
        raise FleetAuthError("unknown signature version")
    out = dict(p.split("=", 1) for p in rest.split() if "=" in p)
    return out


@dataclass(frozen=True)
class Signed:
    """A request whose signature checked out: who sent it, its nonce, its body digest."""

    sender: str
    nonce: str
    body_digest: str

    def body_ok(self, body: bytes) -> bool:
        return hmac.compare_digest(digest(body), self.body_digest)


class Verifier:
    """Checks signed requests for one fleet key, remembering recent nonces."""

    def __init__(self, key: str):
        self.key = key
        self._seen: OrderedDict[str, float] = OrderedDict()

    def check(self, headers: Mapping[str, str], method: str, target: str) -> Signed:
        value = headers.get(AUTH_HEADER.lower()) or headers.get(AUTH_HEADER)
        sender = headers.get(FORWARDED_HEADER.lower()) or headers.get(FORWARDED_HEADER) or ""
        if not value:
            raise FleetAuthError("no fleet signature")
        f = _fields(value)
        try:
            t, n, b, s = f["t"], f["n"], f["b"], f["s"]
            age = abs(time.time() - int(t))
        except (KeyError, ValueError):
            raise FleetAuthError("a malformed fleet signature") from None
        want = _mac(self.key, "request", sender, method.upper(), target, t, n, b)
        if not hmac.compare_digest(want, s):
            raise FleetAuthError("a fleet signature that does not match (another key?)")
        if age > SKEW:
            raise FleetAuthError(f"a signature {age:.0f}s off this node's clock (at most "
                                 f"{SKEW}s: are the clocks set?)")
        now = time.monotonic()
        while self._seen and (len(self._seen) > _NONCES
                              or now - next(iter(self._seen.values())) > 2 * SKEW):
            self._seen.popitem(last=False)
        if n in self._seen:
            raise FleetAuthError("a replayed request (its nonce was seen)")
        self._seen[n] = now
        return Signed(sender, n, b)


def sign_answer(key: str, nonce: str, status: int, body: bytes) -> str:
    """The header value that proves an answer to request ``nonce`` came from a holder
    of ``key``."""
    return "v1 s=" + _mac(key, "answer", nonce, str(status), digest(body))


def answer_ok(key: str, request_headers: Mapping[str, str], status: int, body: bytes,
              answer_header: Optional[str]) -> bool:
    """Whether an answer carries a valid signature for the request we signed."""
    try:
        nonce = _fields(request_headers[AUTH_HEADER])["n"]
        got = _fields(answer_header or "")["s"]
    except (KeyError, FleetAuthError):
        return False
    return hmac.compare_digest(_mac(key, "answer", nonce, str(status), digest(body)), got)
