"""MCP tool servers for the gateway: ``--mcp-config`` and the ``/v1/mcp`` routes.

The config is the JSON desktop assistants use, ``{"mcpServers": {NAME: {"command",
"args", "env", "cwd"} | {"url", "headers"}}}``. Each server gets a task that connects
with the official ``mcp`` SDK (stdio or streamable HTTP), lists its tools, pings it, and
reconnects with backoff when it dies; all stop with the gateway. A bad entry is that
server's error (shown by ``/v1/mcp/status``), not the whole server's.

Safety: commands run without a shell and must be on an allowlist of launchers (the
config's ``allowedCommands`` adds more); environment variables that change how code is
loaded are refused unless ``allowEnv`` names them; every call has a timeout and a cap on
the size of its result.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from quart import Quart, request

from ..manifest import LOADER_ENV, env_matches
from ..wire import APIError, parse_json_body

log = logging.getLogger("mlxfleet.mcp")

#: Launchers MCP servers are usually started with; others need ``allowedCommands``.
DEFAULT_COMMANDS = ("npx", "uvx", "uv", "node", "deno", "bun", "python", "python3",
                    "docker", sys.executable)


#: A server that takes longer than this to list its tools is restarted.
LIVENESS_TIMEOUT = 20.0


class MCPConfigError(ValueError):
    pass


@dataclass
class ServerConfig:
    name: str
    command: Optional[str] = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: Optional[str] = None
    url: Optional[str] = None
    headers: dict[str, str] = field(default_factory=dict)
    error: Optional[str] = None  # why this entry cannot run


def load_config(path: Path) -> dict[str, ServerConfig]:
    """The servers of an MCP config file. A file that is not JSON of the right shape is
    an MCPConfigError; a bad entry becomes that server's ``error``."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise MCPConfigError(f"cannot read MCP config {path}: {e}") from None
    return parse_config(data, str(path))


def parse_config(data: Any, path: str = "the mcp setting") -> dict[str, ServerConfig]:
    """The servers of an MCP config already read (``--mcp-config`` or the settings file's
    ``mcp`` key)."""
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise MCPConfigError(f"{path}: expected {{\"mcpServers\": {{NAME: {{...}}}}}}")
    allowed = [*DEFAULT_COMMANDS, *data.get("allowedCommands", [])]
    allow_env = data.get("allowEnv", [])
    out = {}
    for name, entry in servers.items():
        out[name] = _server(name, entry, allowed, allow_env)
    return out


def _server(name: str, e: Any, allowed: list[str], allow_env: list[str]) -> ServerConfig:
    s = ServerConfig(name)
    if not isinstance(e, dict) or ("command" in e) == ("url" in e):
        s.error = "needs either 'command' (stdio) or 'url' (streamable HTTP)"
        return s
    s.env = {str(k): str(v) for k, v in (e.get("env") or {}).items()}
    s.headers = {str(k): str(v) for k, v in (e.get("headers") or {}).items()}
    s.args = [str(a) for a in e.get("args") or []]
    s.cwd = e.get("cwd")
    if "url" in e:
        s.url = str(e["url"])
        if not s.url.startswith(("http://", "https://")):
            s.error = f"url {s.url!r} is not http(s)"
        return s
    cmd = str(e["command"])
    exe = shutil.which(cmd)
    if exe is None:
        s.error = f"command {cmd!r} is not an executable on PATH"
    elif not any(cmd == a or exe == shutil.which(a) or exe == a for a in allowed):
        s.error = (f"command {cmd!r} is not among the allowed launchers; add it to "
                   "\"allowedCommands\" in the MCP config to run it")
    bad = [k for k in s.env if env_matches(k.upper(), LOADER_ENV) and k not in allow_env]
    if bad:
        s.error = (f"env {', '.join(bad)} would change how code is loaded; list it in "
                   "\"allowEnv\" to allow it")
    s.command = exe or cmd
    return s


class MCPState(str, Enum):
    """An MCP server's state, as ``/v1/mcp/servers`` and ``/v1/status`` show it."""

    STARTING = "starting"  # connecting (first time, or again after a backoff)
    READY = "ready"  # connected; its tools are listed
    BACKOFF = "backoff"  # the connection failed or dropped; retrying after a delay
    INVALID = "invalid"  # its configuration is wrong: never tried


class MCPServer:
    """One configured server: its connection task, state and tools."""

    def __init__(self, cfg: ServerConfig, backoff_cap: float = 30.0):
        self.cfg, self.name = cfg, cfg.name
        self.state = MCPState.INVALID if cfg.error else MCPState.STARTING
        self.error: Optional[str] = cfg.error
        self.tools: list[Any] = []
        self.restarts = 0
        self._client: Any = None
        self._task: Optional[asyncio.Task] = None
        self._backoff_cap = backoff_cap

    def start(self) -> None:
        if self.cfg.error is None:
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _transport(self):
        from mcp import StdioServerParameters

        if self.cfg.url:
            return self.cfg.url
        return StdioServerParameters(command=self.cfg.command, args=self.cfg.args,
                                     env={**_base_env(), **self.cfg.env} or None,
                                     cwd=self.cfg.cwd)

    async def _run(self) -> None:
        from mcp import Client

        delay = 0.5
        while True:
            try:
                async with Client(self._transport()) as client:
                    self.tools = list((await client.list_tools()).tools)
                    self._client, self.state, self.error = client, MCPState.READY, None
                    log.info("MCP server %s: ready, %d tools", self.name, len(self.tools))
                    delay = 0.5
                    while True:  # a server that stops answering is reconnected (listing
                        await asyncio.sleep(5)  # tools: the protocol has no ping any more)
                        self.tools = list((await asyncio.wait_for(client.list_tools(),
                                                                  LIVENESS_TIMEOUT)).tools)
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # noqa: BLE001 - any failure: back off, reconnect
                self.error = _message(e)
                log.warning("MCP server %s: %s; restarting in %.1fs", self.name, self.error,
                            delay)
            self._client, self.state = None, MCPState.BACKOFF
            self.restarts += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._backoff_cap)
            self.state = MCPState.STARTING

    async def call(self, tool: str, arguments: dict, timeout: float) -> Any:
        if self._client is None:
            raise APIError(503, f"MCP server '{self.name}' is {self.state.value}"
                           + (f": {self.error}" if self.error else ""),
                           type="service_unavailable", code="mcp_unavailable",
                           headers={"Retry-After": "2"})
        t0 = time.monotonic()
        try:
            return await asyncio.wait_for(self._client.call_tool(tool, arguments), timeout)
        except Exception as e:  # noqa: BLE001 - a timeout, or the server broke mid-call
            # Cancelling a call can surface as "connection closed" from the SDK: what
            # the client sees is the deadline either way.
            if isinstance(e, TimeoutError) or time.monotonic() - t0 >= timeout * 0.95:
                raise APIError(504, f"MCP tool '{self.name}/{tool}' did not answer within "
                               f"{timeout:g}s.", type="timeout", code="mcp_timeout") from None
            raise APIError(502, f"MCP server '{self.name}' failed: {_message(e)}",
                           type="server_error", code="mcp_failed") from None


def _message(e: BaseException) -> str:
    inner = getattr(e, "exceptions", None)  # anyio wraps failures in groups
    if inner:
        return _message(inner[0])
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _base_env() -> dict[str, str]:
    """What a stdio server inherits: enough to find its runtime, none of our keys."""
    keep = ("PATH", "HOME", "USER", "LANG", "TMPDIR", "SystemRoot")
    return {k: v for k, v in os.environ.items() if k in keep}


class MCPManager:
    def __init__(self, servers: dict[str, ServerConfig], call_timeout: float,
                 max_result_bytes: int):
        self.servers = {n: MCPServer(c) for n, c in servers.items()}
        self.call_timeout, self.max_result_bytes = call_timeout, max_result_bytes
        self.started = time.time()

    def start(self) -> None:
        for s in self.servers.values():
            s.start()

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers.values()))

    def status(self) -> dict[str, Any]:
        return {"servers": [{"name": s.name, "state": s.state.value, "tools": len(s.tools),
                             "restarts": s.restarts, "last_error": s.error,
                             "transport": "http" if s.cfg.url else "stdio"}
                            for s in self.servers.values()]}

    def tools(self) -> list[dict[str, Any]]:
        """Every ready server's tools in OpenAI's format; ``server__tool`` only where two
        servers offer the same name."""
        seen: dict[str, int] = {}
        for s in self.servers.values():
            for t in s.tools:
                seen[t.name] = seen.get(t.name, 0) + 1
        out = []
        for s in self.servers.values():
            for t in s.tools:
                name = t.name if seen[t.name] == 1 else f"{s.name}__{t.name}"
                out.append({"type": "function", "server": s.name, "tool": t.name,
                            "function": {"name": name, "description": t.description or "",
                                         "parameters": _schema(t)}})
        return out

    def locate(self, name: str) -> tuple[str, str]:
        """``server__tool``, or the one server offering ``name`` -> (server, tool)."""
        server, sep, tool = name.partition("__")
        if sep and server in self.servers:
            return server, tool
        having = [s.name for s in self.servers.values() if any(t.name == name
                                                                for t in s.tools)]
        if len(having) == 1:
            return having[0], name
        raise APIError(404 if not having else 400, f"No MCP tool named '{name}'" + (
            "." if not having else f": several servers have it ({', '.join(having)}); send "
            "'server__tool'."), param="tool_name", type="not_found_error" if not having
            else "invalid_request_error", code="mcp_tool_not_found" if not having
            else "ambiguous_tool")

    async def execute(self, server: str, tool: str, arguments: Any) -> dict[str, Any]:
        s = self.servers.get(server)
        if s is None:
            raise APIError(404, f"No MCP server named '{server}'.", param="server",
                           type="not_found_error", code="mcp_server_not_found")
        known = {t.name: t for t in s.tools}
        if s.state is MCPState.READY and tool not in known:
            raise APIError(404, f"MCP server '{server}' has no tool '{tool}'.", param="tool",
                           type="not_found_error", code="mcp_tool_not_found")
        if not isinstance(arguments, dict):
            raise APIError(400, "arguments must be a JSON object.", param="arguments")
        if tool in known:
            _validate(arguments, _schema(known[tool]))
        r = await s.call(tool, arguments, self.call_timeout)
        content = [c.model_dump(exclude_none=True) for c in r.content]
        text = "".join(c.get("text", "") for c in content if c.get("type") == "text")
        truncated = len(text.encode()) > self.max_result_bytes
        if truncated:
            text = text.encode()[:self.max_result_bytes].decode(errors="ignore")
            content = [{"type": "text", "text": text}]
        return {"server": server, "tool": tool, "is_error": bool(r.is_error),
                "content": content, "text": text, "truncated": truncated,
                "structured_content": None if truncated else r.structured_content}


def _schema(t: Any) -> dict[str, Any]:
    return getattr(t, "input_schema", None) or getattr(t, "inputSchema", None) or {
        "type": "object", "properties": {}}


def _validate(arguments: dict, schema: dict) -> None:
    import jsonschema

    try:
        jsonschema.validate(arguments, schema)
    except jsonschema.ValidationError as e:
        where = ".".join(str(p) for p in e.absolute_path)
        raise APIError(400, f"Invalid arguments{' at ' + where if where else ''}: "
                       f"{e.message}", param="arguments", code="invalid_arguments") from None
    except jsonschema.SchemaError:
        pass  # the tool's own schema is broken: let the tool judge


def register_mcp(app: Quart, manager: Optional[MCPManager]) -> None:
    def need() -> MCPManager:
        if manager is None:
            raise APIError(404, "No MCP servers are configured (start with --mcp-config "
                           "FILE).", type="not_found_error", code="mcp_not_configured")
        return manager

    @app.get("/v1/mcp/status")
    async def mcp_status():
        return need().status() if manager else {"servers": []}

    @app.get("/v1/mcp/tools")
    async def mcp_tools():
        """OpenAI-format tools under ``data`` (ours), and vllm-mlx's ``tools`` (``name``,
        ``description``, ``server``, ``parameters``) with ``count``."""
        data = manager.tools() if manager else []
        flat = [{"name": t["function"]["name"], "description": t["function"]["description"],
                 "server": t["server"], "parameters": t["function"]["parameters"]}
                for t in data]
        return {"object": "list", "data": data, "tools": flat, "count": len(flat)}

    @app.get("/v1/mcp/servers")
    async def mcp_servers():
        """vllm-mlx's list of servers."""
        return {"servers": [{"name": s["name"], "state": s["state"],
                             "transport": s["transport"], "tools_count": s["tools"],
                             "error": s["last_error"]}
                            for s in (manager.status()["servers"] if manager else [])]}

    @app.post("/v1/mcp/execute")
    async def mcp_execute():
        """``{"server", "tool", "arguments"}``, or vllm-mlx's ``{"tool_name",
        "arguments"}`` (``server__tool``, or a tool name only one server has)."""
        body = parse_json_body(await request.get_data())
        server, tool = body.get("server"), body.get("tool")
        named = body.get("tool_name")
        if isinstance(named, str) and server is None and tool is None:
            server, tool = need().locate(named)
            out = await need().execute(server, tool, body.get("arguments") or {})
            return {**out, "tool_name": named,
                    "error_message": out["text"] if out["is_error"] else None}
        if not isinstance(server, str) or not isinstance(tool, str):
            raise APIError(400, "Give 'server' and 'tool' (strings) and 'arguments', or "
                           "'tool_name' and 'arguments'.", code="missing_required_parameter")
        return await need().execute(server, tool, body.get("arguments") or {})


#: Rounds of model -> tool calls -> model a Responses request with MCP tools may take.
MAX_TOOL_ROUNDS = 8


def _item_id(prefix: str) -> str:
    import uuid

    return f"{prefix}_{uuid.uuid4().hex[:24]}"


async def respond_with_mcp(manager: Optional[MCPManager], body: dict[str, Any],
                           ask: Any) -> dict[str, Any]:
    """A Responses request whose ``tools`` include ``{"type": "mcp", ...}``: the server
    lists those tools, runs the model's calls itself and feeds the results back, until the
    model answers (at most MAX_TOOL_ROUNDS). ``ask(body) -> response dict`` sends one
    round to the model. Calls needing approval come back as ``mcp_approval_request``
    items, as OpenAI documents."""
    if body.get("stream"):
        raise APIError(400, "Streaming with MCP tools is not supported yet; send "
                       "stream: false.", param="stream", code="unsupported_parameter")
    if manager is None:
        raise APIError(400, "This server has no MCP servers (start it with --mcp-config).",
                       param="tools", code="mcp_not_configured")
    tools, routes, listed = [], {}, []
    for i, t in enumerate(body.get("tools") or []):
        if not isinstance(t, dict) or t.get("type") != "mcp":
            tools.append(t)
            continue
        label = t.get("server_label")
        if t.get("server_url"):
            raise APIError(400, "MCP servers given by server_url are refused: list the "
                           "server in the gateway's --mcp-config and name it by "
                           "server_label.", param=f"tools[{i}].server_url",
                           code="mcp_server_url_refused")
        s = manager.servers.get(label)
        if s is None:
            raise APIError(400, f"No MCP server labelled '{label}' is configured.",
                           param=f"tools[{i}].server_label", code="mcp_server_not_found")
        if s.state is not MCPState.READY:
            raise APIError(503, f"MCP server '{label}' is {s.state.value}.",
                           type="service_unavailable", code="mcp_unavailable",
                           headers={"Retry-After": "2"})
        allowed = t.get("allowed_tools")
        names = allowed.get("tool_names") if isinstance(allowed, dict) else allowed
        chosen = [x for x in s.tools if names is None or x.name in names]
        listed.append({"type": "mcp_list_tools", "id": _item_id("mcpl"), "server_label": label,
                       "tools": [{"name": x.name, "description": x.description or "",
                                  "input_schema": _schema(x)} for x in chosen]})
        approval = t.get("require_approval", "always")
        for x in chosen:
            routes[x.name] = (label, approval != "never")
            tools.append({"type": "function", "name": x.name,
                          "description": x.description or "", "parameters": _schema(x)})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "mcp":
        choice = {"type": "function", "name": choice.get("name")}
    inp = body.get("input")
    history = [{"type": "message", "role": "user", "content": inp}] \
        if isinstance(inp, str) else list(inp or [])
    output: list[dict[str, Any]] = [*listed]
    resp: dict[str, Any] = {}
    for _ in range(MAX_TOOL_ROUNDS):
        resp = await ask({**body, "tools": tools, "tool_choice": choice, "input": history,
                          "stream": False})
        calls = [o for o in resp.get("output", []) if o.get("type") == "function_call"]
        mine = [c for c in calls if c.get("name") in routes]
        if not mine:
            break
        if any(routes[c["name"]][1] for c in mine):  # approval first, as OpenAI does
            output += [{"type": "mcp_approval_request", "id": _item_id("mcpr"),
                        "server_label": routes[c["name"]][0], "name": c["name"],
                        "arguments": c.get("arguments", "{}")} for c in mine]
            resp["output"] = []
            break
        for c in mine:
            label = routes[c["name"]][0]
            item = {"type": "mcp_call", "id": _item_id("mcp"), "server_label": label,
                    "name": c["name"], "arguments": c.get("arguments", "{}"),
                    "output": None, "error": None}
            try:
                r = await manager.execute(label, c["name"], json.loads(item["arguments"]))
                item["output"] = r["text"]
                if r["is_error"]:
                    item["error"] = r["text"]
            except (APIError, ValueError) as e:
                item["error"] = getattr(e, "message", str(e))
            output.append(item)
            history += [c, {"type": "function_call_output", "call_id": c.get("call_id"),
                            "output": item["output"] or item["error"] or ""}]
        choice = "auto"  # a forced call is forced once
    resp["output"] = output + [o for o in resp.get("output", [])
                               if not (o.get("type") == "function_call"
                                       and o.get("name") in routes)]
    resp["tools"] = body.get("tools") or []
    return resp
