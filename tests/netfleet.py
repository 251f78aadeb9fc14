"""A fleet in network namespaces, with a userspace forwarder between its nodes.

Each node runs in its own network namespace (``ip netns exec``), its veth on a bridge in
a "switch" namespace; nothing is added to the machine's own namespace. The nodes reach
each other only through ``Forwarder``, which runs in a thread of the test process that
entered the switch namespace (``setns`` is per thread): it listens on the switch's
address, one port per node, and relays each connection to that node, knowing the
sender by its address. So it can delay and lose (this kernel has no netem: a lost TCP
segment is a retransmission stall, which is what the forwarder adds), and cut one
direction between two nodes (a one-way partition: the connection is taken and then
nothing goes through, as a silent link). Clients (the tests) reach each node's gateway
through the same thread, on 127.0.0.1 of the test's own namespace.

Addresses: 10.213.X.0/24 inside the namespaces only (X random per run).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from served import Served

CLONE_NEWNET = 0x40000000


def can_make_namespaces() -> Optional[str]:
    """Why this machine cannot run the namespaced fleet, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if subprocess.run(["ip", "-V"], capture_output=True).returncode != 0:
        return "no iproute2 (ip)"
    name = f"mft-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot make a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Net:
    """The switch namespace and one namespace per node, removed by ``close``."""

    def __init__(self, names: str):
        tag = f"{os.getpid() % 10000}"
        self.subnet = f"10.213.{random.randint(1, 254)}"
        self.switch = f"mft{tag}-sw"
        self.ns = {n: f"mft{tag}-{n}" for n in names}
        self.addr = {n: f"{self.subnet}.{i + 1}" for i, n in enumerate(names)}
        self.hub = f"{self.subnet}.254"  # the switch's own address: the forwarder's
        self.veth = {n: f"v{tag}{n}" for n in names}
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "addr", "add", f"{self.hub}/24", "dev", "br0")
        for dev in ("br0", "lo"):
            ip("-n", self.switch, "link", "set", dev, "up")
        for n in names:
            ns, v = self.ns[n], self.veth[n]
            ip("netns", "add", ns)
            ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", v,
               "netns", self.switch)
            ip("-n", self.switch, "link", "set", v, "master", "br0")
            ip("-n", self.switch, "link", "set", v, "up")
            ip("-n", ns, "addr", "add", f"{self.addr[n]}/24", "dev", "eth0")
            for dev in ("eth0", "lo"):
                ip("-n", ns, "link", "set", dev, "up")

    def link(self, node: str, up: bool) -> None:
        """The node's cable, pulled or plugged back (the kernel's link, not the forwarder)."""
        ip("-n", self.switch, "link", "set", self.veth[node], "up" if up else "down")

    def close(self) -> None:
        for ns in (*self.ns.values(), self.switch):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class Forwarder:
    """TCP relays in the switch namespace, with delay, loss and cut directions."""

    def __init__(self, net: Net):
        self.net = net
        self.delay = 0.0  # seconds each chunk waits, each way
        self.loss = 0.0  # the share of chunks held for a retransmission timeout
        self.rto = 0.2  # Linux's minimum retransmission timeout
        self.cut: set[tuple[str, str]] = set()  # (from node, to node): nothing passes
        self.by_addr = {a: n for n, a in net.addr.items()}
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._jobs: list[tuple] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    # ---- what the tests call --------------------------------------------------

    def node_port(self, node: str, port: int) -> None:
        """Nodes reach ``node`` at hub:port (its Node url), relayed to its own address."""
        self._call(self._listen, (self.net.hub, port), (self.net.addr[node], port), node,
                   None)

    def client_port(self, node: str, root_sock: socket.socket, port: int) -> None:
        """The test reaches ``node``'s gateway at ``root_sock`` (bound in the test's
        namespace), relayed to the node's port ``port``."""
        self._call(self._listen, root_sock, (self.net.addr[node], port), node, "client")

    def partition(self, a: str, b: str, both: bool = True) -> None:
        self.cut.add((a, b))
        if both:
            self.cut.add((b, a))

    def heal(self) -> None:
        self.cut.clear()

    # ---- the thread -----------------------------------------------------------

    def _run(self) -> None:
        fd = os.open(f"/var/run/netns/{self.net.switch}", os.O_RDONLY)
        self._root_socks: list[socket.socket] = []
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:  # this thread only: the test's stay home
            raise OSError(ctypes.get_errno(), "setns")
        os.close(fd)
        asyncio.set_event_loop(self._loop)
        self._ready.set()
        self._loop.run_forever()

    def _call(self, fn, *args) -> None:
        asyncio.run_coroutine_threadsafe(fn(*args), self._loop).result(10)

    async def _listen(self, where, target: tuple[str, int], node: str,
                      kind: Optional[str]) -> None:
        async def on_conn(reader, writer):
            peer = writer.get_extra_info("peername")[0]
            src = "client" if kind == "client" else self.by_addr.get(peer, "?")
            try:
                r2, w2 = await asyncio.wait_for(asyncio.open_connection(*target), 5)
            except (OSError, asyncio.TimeoutError):
                writer.close()
                return
            await asyncio.gather(self._pipe(reader, w2, src, node),
                                 self._pipe(r2, writer, node, src), return_exceptions=True)

        if isinstance(where, socket.socket):
            await asyncio.start_server(on_conn, sock=where)
        else:
            await asyncio.start_server(on_conn, *where, reuse_address=True)

    async def _pipe(self, reader, writer, src: str, dst: str) -> None:
        """Bytes from ``src`` to ``dst``, each chunk delivered ``delay`` later (a lost
        one an RTO later still, and the ones behind it wait: TCP is in order); while
        the direction is cut nothing is delivered, and it resumes when healed."""
        q: asyncio.Queue = asyncio.Queue()

        async def deliver():
            while True:
                due, data = await q.get()
                if data is None:
                    break
                while (src, dst) in self.cut:
                    await asyncio.sleep(0.05)
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            writer.close()

        task = asyncio.ensure_future(deliver())
        try:
            while data := await reader.read(65536):
                clients = "client" in (src, dst)
                extra = 0.0 if clients else self.delay + (
                    self.rto if random.random() < self.loss else 0.0)
                q.put_nowait((time.monotonic() + extra, data))
        except OSError:
            pass
        q.put_nowait((0.0, None))
        await task


class NsServed(Served):
    """A node of the fleet, run in its namespace; its gateway reached through the
    forwarder on 127.0.0.1 (same port number in the test's namespace as in its own)."""

    def __init__(self, root: Path, env: dict, manifests: Path, node: str, net: Net,
                 fwd: Forwarder):
        super().__init__(root, env, manifests=manifests, args=("--node", node))
        self.node, self.net, self.fwd = node, net, fwd
        sock = socket.socket()
        sock.bind(("127.0.0.1", self.port))
        sock.listen(128)
        sock.setblocking(False)
        fwd.client_port(node, sock, self.port)

    def launch(self) -> None:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.net.ns[self.node], sys.executable, "-m", "mlxfleet",
             "serve", "--manifests", str(self.dir), "--host", "0.0.0.0", "--insecure",
             "--port", str(self.port), "--state-dir", str(self.state), *self.args],
            stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
