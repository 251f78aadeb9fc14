"""``mlxfleet serve``: the supervisor and the gateway in one process and event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any, Optional

import uvicorn

from .settings import ServerSettings

log = logging.getLogger("mlxfleet")


async def serve(settings: ServerSettings) -> None:
    from .accelerator import check_backend
    from .api.gateway import create_gateway
    from .api.guard import is_loopback
    from .supervisor.supervisor import Supervisor

    if not is_loopback(settings.host) and not settings.api_keys and not settings.insecure:
        raise SystemExit(f"error: refusing to serve on {settings.host} (not loopback) without "
                         "an API key: anyone who can reach the port would get a free LLM. "
                         "Set --api-key (or MLXFLEET_API_KEY), or pass --insecure.")
    check_backend()
    node_listener = _check_node(settings) if settings.node else None
    _check_port(settings.host, settings.port)
    if node_listener is not None:
        _check_port(*node_listener[:2])
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    supervisor = Supervisor(settings)

    def hangup() -> None:  # `systemctl reload`, `kill -HUP`: read the folder now, keep serving
        log.info("SIGHUP: reading the manifests folder again")
        asyncio.ensure_future(supervisor.reload())

    if hasattr(signal, "SIGHUP"):  # (it killed the server without a drain)
        loop.add_signal_handler(signal.SIGHUP, hangup)
    mcp = _mcp_manager(settings)
    app = create_gateway(supervisor, mcp)
    node_server: list[_Server] = []  # the TLS listener for the other nodes, once started
    node_task: list[asyncio.Task] = []

    @app.before_serving
    async def _start():
        if mcp is not None:
            mcp.start()
        await supervisor.start()
        log.info("mlxfleet gateway on http://%s:%s, manifests in %s", settings.host,
                 settings.port, supervisor.manifests_dir)
        if node_listener is not None:  # after the supervisor: the other nodes' requests
            host, port, tls = node_listener  # need it
            node_server.append(_Server(_config(app, settings, host, port, lifespan="off",
                                               **tls.server_options())))
            node_task.append(asyncio.create_task(node_server[0].serve()))
            log.info("node %s: the fleet's nodes reach it on https://%s:%s (mutual TLS, "
                     "fleet CA %s)", settings.node, host, port, tls.ca)

    @app.after_serving
    async def _stop():
        log.info("stopping: draining requests and workers")
        if node_task:
            node_server[0].should_exit = True
            await node_task[0]
        await supervisor.stop()
        if mcp is not None:
            await mcp.stop()

    server = _Server(_config(app, settings, settings.host, settings.port, lifespan="on"))
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # ours says where we are
    watch = asyncio.create_task(stop.wait())
    watch.add_done_callback(lambda _: [setattr(x, "should_exit", True)
                                       for x in (server, *node_server)])
    await server.serve()


def _config(app: Any, settings: ServerSettings, host: str, port: int,
            **extra: Any) -> uvicorn.Config:
    """A listener of the gateway's app: the client port, or the TLS node port (``extra``:
    lifespan, TLS). uvicorn with httptools: the cheapest server for the hop every request
    takes (benchmarks/hop.py; Hypercorn's h11 parsing cost ~0.6 ms more per request)."""
    return uvicorn.Config(
        app, host=host, port=port, http=_head_timeout(settings.header_timeout),
        timeout_graceful_shutdown=settings.drain_timeout, timeout_keep_alive=75,
        access_log=False, log_config=None, server_header=False, ws="none",
        proxy_headers=False, **extra)  # the peer address is the client's, as before


def _head_timeout(seconds: float) -> type:
    """uvicorn's httptools protocol, with a deadline for each request's head: uvicorn
    times out idle kept-alive connections, but a client that sends its request line and
    headers slowly (or never) held a connection forever (slowloris). Past the deadline
    it gets a 408 and the connection closes, as nginx's ``client_header_timeout`` does."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from .fleet_tls import SCOPE_NODE, peer_node

    class HeadTimeoutProtocol(HttpToolsProtocol):
        _head_timer = None

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _too_slow(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n"
                                     b"connection: close\r\n\r\n")
                self.transport.close()

        def connection_made(self, transport):  # type: ignore[override]
            super().connection_made(transport)
            # On the node listener (mutual TLS): the node the client's certificate names,
            # put in each request's scope for the guard (uvicorn does not pass it on)
            tls = transport.get_extra_info("ssl_object")
            self._node = peer_node(tls.getpeercert()) if tls is not None else None
            self._arm()

        def on_message_begin(self) -> None:  # the next request on a kept connection
            super().on_message_begin()
            self.scope[SCOPE_NODE] = self._node  # type: ignore[literal-required]
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeadTimeoutProtocol


class _Server(uvicorn.Server):
    """uvicorn, with our own signal handlers (set above): its own would re-raise the
    signal after a clean shutdown and turn exit code 0 into a kill."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _mcp_manager(settings: ServerSettings):
    """The MCP servers of ``--mcp-config``, not started yet (None without a config)."""
    if settings.mcp_config is None and settings.mcp is None:
        return None
    from .api.mcp import MCPConfigError, MCPManager, load_config, parse_config

    try:
        import mcp  # noqa: F401
    except ImportError:
        raise SystemExit("error: --mcp-config needs the MCP SDK: pip install "
                         "'mlxfleet[mcp]'") from None
    try:
        servers = load_config(settings.mcp_config) if settings.mcp_config is not None \
            else parse_config(settings.mcp)
    except MCPConfigError as e:
        raise SystemExit(f"error: {e}") from None
    for s in servers.values():
        if s.error:
            log.error("MCP server %s: %s", s.name, s.error)
    return MCPManager(servers, settings.mcp_call_timeout, settings.mcp_max_result_kb << 10)


def _check_node(settings: ServerSettings) -> Optional[tuple[str, int, Any]]:
    """A node must be named by a Node manifest, must not talk to other nodes in the
    clear beyond loopback unless told to, and must not without a fleet key. Returns
    where its TLS node listener binds (host, port, its ``FleetTLS``) when this machine
    joined a fleet (``mlxfleet fleet init`` / ``join``), else None."""
    from urllib.parse import urlsplit

    from .api.guard import is_loopback
    from .fleet_tls import FleetTLS, FleetTLSError
    from .manifest import load_paths

    results = load_paths([settings.manifests_dir]) if settings.manifests_dir.is_dir() else []
    nodes = {n.name: n for r in results for n in r.nodes}
    if settings.node not in nodes:
        known = ", ".join(sorted(nodes)) or "none"
        raise SystemExit(f"error: no kind: Node manifest named {settings.node!r} in "
                         f"{settings.manifests_dir} (nodes there: {known}). Add one with "
                         "metadata.name and spec.url, or start without --node.")
    try:
        tls = FleetTLS.load(settings.fleet_folder, settings.node)
    except (FleetTLSError, ValueError) as e:
        raise SystemExit(f"error: the fleet folder {settings.fleet_folder}: {e}") from None
    if tls is not None and not settings.fleet_key:
        settings.fleet_key = tls.fleet_key()
    if (settings.api_keys or not is_loopback(settings.host)) and not settings.fleet_key:
        why = "binds beyond loopback" if not is_loopback(settings.host) else "has API keys"
        raise SystemExit(f"error: node {settings.node} {why} but has no fleet key: other "
                         "nodes could not be told apart from anyone who reaches the port. "
                         "Make the fleet with `mlxfleet fleet init` (docs/fleet.md), or set "
                         "--fleet-key (MLXFLEET_FLEET_KEY), the same on every node.")
    urls = {name: urlsplit(n.spec.url) for name, n in nodes.items()}
    plain = sorted(name for name, u in urls.items() if u.scheme == "http")
    if tls is not None:
        if plain:
            raise SystemExit(f"error: this machine joined a fleet with TLS "
                             f"({settings.fleet_folder}), so every Node url is https://; "
                             f"these are not: {', '.join(plain)}")
        u = urls[settings.node]
        host = settings.node_bind or (u.hostname if _is_ip(u.hostname or "") else "0.0.0.0")
        return host, u.port or 443, tls
    clear = [name for name in plain if not is_loopback(urls[name].hostname or "")]
    if clear and not settings.fleet_plain_http:
        raise SystemExit(f"error: nodes {', '.join(clear)} are reached over plain http:// "
                         "beyond loopback: prompts and answers would cross the network in "
                         "clear. Make the fleet with TLS (`mlxfleet fleet init`, then "
                         "`fleet join` on each node, and https:// urls: docs/fleet.md), or "
                         "set fleet_plain_http (MLXFLEET_FLEET_PLAIN_HTTP=1) on a network "
                         "you trust.")
    return None


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _check_port(host: str, port: int) -> None:
    """Fail fast, with one clear line, when the address cannot be listened on."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will
        try:
            s.bind((host.strip("[]"), port))
        except OSError as e:
            raise SystemExit(f"error: cannot listen on {host}:{port}: "
                             f"{e.strerror or e} (is another server running there?)") from None
