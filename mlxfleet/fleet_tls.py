"""TLS between the nodes of a fleet: a fleet CA, a certificate per node that names the
node, and joining with a token that pins the CA (after kubeadm's ``join``).

The fleet folder (``fleet_dir``, default ``STATE/fleet``: 0700, every file 0600)::

    ca.pem       the fleet CA's certificate (every node)
    ca.key       its private key (only the node that ran ``fleet init``: it signs joins)
    tokens.json  the join tokens that node issued (id, secret, expiry)
    node.pem     this node's certificate: CN NAME, DNS name NAME.node.mlxfleet
    node.key     its private key (it never leaves the machine: a join sends a CSR)
    key          the fleet key that signs every request between nodes (fleet_auth)

A certificate names its node, not an address: a node reaching another asks TLS for
``NAME.node.mlxfleet`` (SNI and the hostname check) whatever host or IP the Node
manifest's url has, so the server it reached is the node it meant, and addresses may
change (DHCP, .local) without new certificates. Servers ask every client for a
certificate of the fleet CA (mutual TLS) and read its node name, which must be the
node that signed the request.

Joining: ``fleet init`` prints ``mlxfleet fleet join URL NODE --token ID.SECRET
--ca-hash sha256:...``. The new node makes its key and a CSR, and sends the CSR with an
HMAC keyed by the token's secret; the CA node answers the certificate, the CA and the
fleet key sealed with a key derived from the secret (AES-GCM), all MACed by the same
secret; the new node checks the MAC and that the CA's public key hashes to the pinned
value before it writes anything. The exchange may cross plain HTTP: nothing in it is
of use without the token, and the token never crosses the wire.

Written on ``cryptography`` (X.509, ECDSA P-256, HKDF, AES-GCM); the protocol around it
is ours, 200 lines: no library speaks a join with a pinned CA.
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import hashlib
import hmac
import json
import os
import re
import secrets
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

NODE_DOMAIN = "node.mlxfleet"
JOIN_ROUTE = "/mlxfleet/v1/join"
#: The ASGI scope key under which the server puts the node name of the client's
#: certificate (None on a connection without one: the client listener).
SCOPE_NODE = "mlxfleet.node"
CA_YEARS, NODE_YEARS = 10, 3
_HEX = re.compile(r"[0-9a-f]+")  # a nonce as sent: bytes.fromhex must take it
TOKEN_TTL = 24 * 3600.0


class FleetTLSError(Exception):
    """A fleet folder, token, certificate or join answer that cannot be used (``status``:
    the HTTP status a join request that raised it gets)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def node_dns(node: str) -> str:
    """The DNS name a node's certificate carries, and that TLS is asked for."""
    return f"{node}.{NODE_DOMAIN}"


def _write(path: Path, data: bytes) -> None:
    """Atomically, 0600 from the first byte (a key must never be readable by others)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization as s

    return key.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.NoEncryption())


def _cert_pem(cert) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding

    return cert.public_bytes(Encoding.PEM)


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def ca_hash(ca_pem: bytes) -> str:
    """``sha256:`` and the hash of the CA's public key (its SubjectPublicKeyInfo), as
    kubeadm's ``--discovery-token-ca-cert-hash``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization as s

    spki = x509.load_pem_x509_certificate(ca_pem).public_key().public_bytes(
        s.Encoding.DER, s.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(spki).hexdigest()


def cert_node(cert: Any) -> Optional[str]:
    """The node a certificate names: its DNS name under ``node.mlxfleet``."""
    from cryptography import x509

    try:
        names = cert.extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        return None
    suffix = "." + NODE_DOMAIN
    found = [n[: -len(suffix)] for n in names if n.endswith(suffix)]
    return found[0] if len(found) == 1 else None


def peer_node(peercert: Optional[dict]) -> Optional[str]:
    """The node named by a verified peer certificate as ``ssl`` gives it
    (``getpeercert()``), or None."""
    suffix = "." + NODE_DOMAIN
    found = [v[: -len(suffix)] for k, v in (peercert or {}).get("subjectAltName", ())
             if k == "DNS" and v.endswith(suffix)]
    return found[0] if len(found) == 1 else None


def _issue(ca_key, ca_cert, node: str, public_key) -> Any:
    """A certificate for ``node``'s key, valid for server and client authentication."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    now = dt.datetime.now(dt.timezone.utc)
    return (x509.CertificateBuilder()
            .subject_name(_name(node)).issuer_name(ca_cert.subject)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=365 * NODE_YEARS))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(node_dns(node))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))


# ---- the fleet folder -------------------------------------------------------------

@dataclass(frozen=True)
class FleetTLS:
    """This node's TLS material in the fleet folder ``dir``."""

    dir: Path
    node: str

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    @property
    def cert(self) -> Path:
        return self.dir / "node.pem"

    @property
    def key(self) -> Path:
        return self.dir / "node.key"

    @staticmethod
    def load(dir: Path, node: str) -> Optional[FleetTLS]:
        """The material of ``node`` in ``dir``; None when this machine never joined a
        fleet. A certificate for another node, or one the CA did not sign, is an error."""
        from cryptography import x509

        tls = FleetTLS(Path(dir), node)
        if not tls.cert.exists():
            return None
        for p in (tls.ca, tls.key):
            if not p.exists():
                raise FleetTLSError(f"{p} is missing (the fleet folder {dir} is incomplete: "
                                    "join again)")
        cert = x509.load_pem_x509_certificate(tls.cert.read_bytes())
        named = cert_node(cert)
        if named != node:
            raise FleetTLSError(f"this machine joined the fleet as node {named!r} "
                                f"({tls.cert}), not {node!r}: start it with --node {named}, "
                                "or join again under the new name")
        ca = x509.load_pem_x509_certificate(tls.ca.read_bytes())
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, Exception) as e:
            raise FleetTLSError(f"{tls.cert} was not issued by the fleet CA {tls.ca}: "
                                f"{e or type(e).__name__}") from None
        return tls

    def fleet_key(self) -> Optional[str]:
        p = self.dir / "key"
        return p.read_text().strip() if p.exists() else None

    def client_context(self) -> ssl.SSLContext:
        """What this node dials other nodes with: the fleet CA only, its own
        certificate presented."""
        return _client_context(str(self.ca), str(self.cert), str(self.key))

    def server_options(self) -> dict[str, Any]:
        """uvicorn's TLS settings for the node listener: a client certificate of the
        fleet CA required."""
        return {"ssl_certfile": str(self.cert), "ssl_keyfile": str(self.key),
                "ssl_ca_certs": str(self.ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}


@functools.lru_cache(maxsize=4)
def _client_context(ca: str, cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx


def init(dir: Path, node: str, ttl: float = TOKEN_TTL) -> tuple[str, str]:
    """Make a fleet in ``dir``: its CA, ``node``'s certificate, the fleet key; returns
    (a join token, the CA hash)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    dir = _folder(Path(dir))
    if (dir / "ca.key").exists() or (dir / "node.pem").exists():
        raise FleetTLSError(f"{dir} holds a fleet already (fleet show tells which); remove "
                            "it first to start a new one")
    ca_key = _new_key()
    subject = _name(f"mlxfleet fleet CA {secrets.token_hex(4)}")
    now = dt.datetime.now(dt.timezone.utc)
    ca = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=365 * CA_YEARS))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False),
                         critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    node_key = _new_key()
    _write(dir / "ca.key", _key_pem(ca_key))
    _write(dir / "ca.pem", _cert_pem(ca))
    _write(dir / "node.key", _key_pem(node_key))
    _write(dir / "node.pem", _cert_pem(_issue(ca_key, ca, node, node_key.public_key())))
    _write(dir / "key", secrets.token_urlsafe(32).encode())
    return new_token(dir, ttl), ca_hash(_cert_pem(ca))


def new_token(dir: Path, ttl: float = TOKEN_TTL) -> str:
    """A join token (``ID.SECRET``) valid for ``ttl`` seconds; only the CA node makes
    them, as only it signs certificates."""
    dir = Path(dir)
    if not (dir / "ca.key").exists():
        raise FleetTLSError(f"{dir} has no fleet CA key: make tokens on the node that ran "
                            "`mlxfleet fleet init`")
    tokens = {k: v for k, v in _tokens(dir).items() if v["expires"] > time.time()}
    tid, secret = secrets.token_hex(3), secrets.token_hex(16)
    tokens[tid] = {"secret": secret, "expires": time.time() + ttl}
    _write(dir / "tokens.json", json.dumps(tokens).encode())
    return f"{tid}.{secret}"


def _tokens(dir: Path) -> dict[str, dict]:
    try:
        data = json.loads((Path(dir) / "tokens.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _split(token: str) -> tuple[str, str]:
    tid, _, secret = token.strip().partition(".")
    if len(tid) != 6 or len(secret) != 32:
        raise FleetTLSError("a join token looks like abc123.0123456789abcdef0123456789abcdef "
                            "(what `mlxfleet fleet init` or `fleet token` printed)")
    return tid, secret


def _mac(secret: str, *parts: str) -> str:
    return hmac.new(secret.encode(), "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def _same(a: str, b: str) -> bool:
    """Constant-time equality of two strings, whatever they hold (``compare_digest``
    raises on non-ASCII ones: a 500 for a hostile join request)."""
    return hmac.compare_digest(a.encode(), b.encode())


def _sealer(secret: str, nonce: str):
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    key = HKDF(hashes.SHA256(), 32, nonce.encode(), b"mlxfleet join").derive(secret.encode())
    return AESGCM(key)


def _sha(data: str) -> str:
    return hashlib.sha256(data.encode()).hexdigest()


# ---- joining ----------------------------------------------------------------------

def join_request(token: str, node: str) -> tuple[dict, bytes]:
    """What a new node sends (its CSR, MACed with the token's secret), and its new
    private key (PEM), which stays here."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    tid, secret = _split(token)
    key = _new_key()
    csr = (x509.CertificateSigningRequestBuilder().subject_name(_name(node))
           .sign(key, hashes.SHA256()))
    csr_pem = _cert_pem(csr).decode()
    nonce = secrets.token_hex(16)
    return ({"node": node, "csr": csr_pem, "token": tid, "nonce": nonce,
             "mac": _mac(secret, "join", node, nonce, _sha(csr_pem))}, _key_pem(key))


def answer_join(dir: Path, body: Any) -> dict:
    """The CA node's answer to a join request: the node's certificate, the CA and the
    sealed fleet key, MACed; ``FleetTLSError`` when the request is not good."""
    from cryptography import x509

    from .names import model_name

    dir = Path(dir)
    if not (dir / "ca.key").exists():
        raise FleetTLSError("this node does not hold the fleet's CA key: join through the "
                            "node that ran `mlxfleet fleet init`", 404)
    if not isinstance(body, dict) or not all(isinstance(body.get(k), str) for k in
                                             ("node", "csr", "token", "nonce", "mac")):
        raise FleetTLSError("a join request has node, csr, token, nonce and mac")
    node, nonce = body["node"], body["nonce"]
    try:
        model_name(node)
    except ValueError as e:
        raise FleetTLSError(f"node name: {e}") from None
    entry = _tokens(dir).get(body["token"])
    if not isinstance(entry, dict) or entry.get("expires", 0) < time.time():
        raise FleetTLSError("unknown or expired join token (make one with "
                            "`mlxfleet fleet token` on the CA node)", 401)
    secret = str(entry["secret"])
    if not (_HEX.fullmatch(nonce) and len(nonce) == 32) or not _same(
            _mac(secret, "join", node, nonce, _sha(body["csr"])), body["mac"]):
        raise FleetTLSError("the join request is not MACed with the token's secret", 401)
    try:
        csr = x509.load_pem_x509_csr(body["csr"].encode())
        if not csr.is_signature_valid:
            raise ValueError("its signature does not verify")
    except ValueError as e:
        raise FleetTLSError(f"the CSR cannot be used: {e}") from None
    from cryptography.hazmat.primitives import serialization as s

    ca_key = s.load_pem_private_key((dir / "ca.key").read_bytes(), None)
    ca_pem = (dir / "ca.pem").read_bytes()
    cert = _issue(ca_key, x509.load_pem_x509_certificate(ca_pem), node, csr.public_key())
    cert_pem = _cert_pem(cert).decode()
    fleet_key = (dir / "key").read_bytes()
    sealed = base64.b64encode(_sealer(secret, nonce).encrypt(bytes.fromhex(nonce)[:12],
                                                             fleet_key, node.encode())).decode()
    ca_text = ca_pem.decode()
    return {"ca": ca_text, "cert": cert_pem, "key": sealed,
            "mac": _mac(secret, "joined", node, nonce, _sha(ca_text), _sha(cert_pem), sealed)}


def finish_join(dir: Path, token: str, pinned: str, sent: dict, node_key: bytes,
                answer: Any) -> None:
    """Check the CA node's answer to ``sent`` and write this node's fleet folder."""
    from cryptography import x509

    dir = Path(dir)
    _, secret = _split(token)
    node, nonce = sent["node"], sent["nonce"]
    if not isinstance(answer, dict) or not all(isinstance(answer.get(k), str) for k in
                                               ("ca", "cert", "key", "mac")):
        raise FleetTLSError("the answer is not a join answer")
    want = _mac(secret, "joined", node, nonce, _sha(answer["ca"]), _sha(answer["cert"]),
                answer["key"])
    if not _same(want, answer["mac"]):
        raise FleetTLSError("the answer is not MACed with the token's secret: whoever "
                            "answered does not hold the token (not the fleet's CA node?)")
    got = ca_hash(answer["ca"].encode())
    if not _same(got, pinned.strip().lower()):
        raise FleetTLSError(f"the fleet's CA hashes to {got}, not the pinned {pinned}: "
                            "refused, nothing written")
    ca = x509.load_pem_x509_certificate(answer["ca"].encode())
    cert = x509.load_pem_x509_certificate(answer["cert"].encode())
    cert.verify_directly_issued_by(ca)
    if cert_node(cert) != node:
        raise FleetTLSError(f"the certificate names node {cert_node(cert)!r}, not {node!r}")
    try:
        key = _sealer(secret, nonce).decrypt(bytes.fromhex(nonce)[:12],
                                             base64.b64decode(answer["key"]), node.encode())
    except Exception:  # (cryptography's InvalidTag; a bad base64)
        raise FleetTLSError("the sealed fleet key does not open with the token") from None
    dir = _folder(dir)
    if (dir / "node.pem").exists():
        raise FleetTLSError(f"{dir} holds a fleet's certificate already")
    _write(dir / "ca.pem", answer["ca"].encode())
    _write(dir / "node.key", node_key)
    _write(dir / "key", key)
    _write(dir / "node.pem", answer["cert"].encode())  # last: it says "joined"


def describe(dir: Path) -> dict[str, Any]:
    """What ``mlxfleet fleet show`` prints."""
    from cryptography import x509

    dir = Path(dir)
    out: dict[str, Any] = {"dir": str(dir), "joined": (dir / "node.pem").exists(),
                           "ca_node": (dir / "ca.key").exists()}
    if (dir / "ca.pem").exists():
        out["ca_hash"] = ca_hash((dir / "ca.pem").read_bytes())
    if out["joined"]:
        cert = x509.load_pem_x509_certificate((dir / "node.pem").read_bytes())
        out["node"] = cert_node(cert)
        out["expires"] = cert.not_valid_after_utc.isoformat()
    if out["ca_node"]:
        out["tokens"] = sum(1 for v in _tokens(dir).values()
                            if isinstance(v, dict) and v.get("expires", 0) > time.time())
    return out
