"""MCP tool servers behind the gateway: real stdio servers written with the SDK's
MCPServer (two tools; one that dies after its first call; one that hangs), driven through
the /v1/mcp routes and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from served import Served, manifest, wait_for

CALC = '''
from mcp.server.mcpserver import MCPServer
app = MCPServer("calc")

@app.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

@app.tool()
def echo(text: str) -> str:
    """Echo text back."""
    return text

app.run()
'''
CRASHER = '''
import os
from mcp.server.mcpserver import MCPServer
app = MCPServer("crasher")

@app.tool()
def add(a: int, b: int) -> int:
    """Add, then die."""
    os._exit(1)

app.run()
'''
HANGER = '''
import time
from mcp.server.mcpserver import MCPServer
app = MCPServer("hanger")

@app.tool()
def wait() -> str:
    """Never answers."""
    time.sleep(3600)
    return "done"

app.run()
'''


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("mcp")
    servers = {}
    for name, code in (("calc", CALC), ("crasher", CRASHER), ("hanger", HANGER)):
        (root / f"{name}.py").write_text(code)
        servers[name] = {"command": sys.executable, "args": [str(root / f"{name}.py")]}
    servers["bad"] = {"command": "/no/such/binary"}
    servers["sneaky"] = {"command": sys.executable, "args": ["-c", "pass"],
                         "env": {"LD_PRELOAD": "/tmp/x.so"}}
    (root / "mcp.json").write_text(json.dumps({"mcpServers": servers}))
    f = Served(root, env={"MLXFLEET_MCP_CONFIG": str(root / "mcp.json"),
                         "MLXFLEET_MCP_CALL_TIMEOUT": "3", "MLXFLEET_MCP_MAX_RESULT_KB": "1"})
    f.write("tiny.yaml", manifest("tiny", preload=False))
    f.start()
    assert wait_for(lambda: state(f, "calc") == "ready" and state(f, "crasher") == "ready"
                    and state(f, "hanger") == "ready", 60), f.logs()
    yield f
    f.stop()


def status(f: Served) -> dict:
    return {s["name"]: s for s in httpx.get(f.url + "/v1/mcp/status").json()["servers"]}


def state(f: Served, name: str) -> str:
    return status(f)[name]["state"]


def execute(f: Served, **body) -> httpx.Response:
    return httpx.post(f.url + "/v1/mcp/execute", json=body, timeout=30)


def test_status_and_tools_in_openai_format(served):
    s = status(served)
    assert s["calc"]["tools"] == 2 and s["calc"]["transport"] == "stdio"
    assert s["bad"]["state"] == "invalid" and "/no/such/binary" in s["bad"]["last_error"]
    assert s["sneaky"]["state"] == "invalid" and "LD_PRELOAD" in s["sneaky"]["last_error"]
    tools = httpx.get(served.url + "/v1/mcp/tools").json()["data"]
    names = {t["function"]["name"] for t in tools}
    # add exists on two servers: only there is the name made unique
    assert {"calc__add", "crasher__add", "echo", "wait"} <= names
    (echo,) = [t for t in tools if t["function"]["name"] == "echo"]
    assert echo["type"] == "function" and echo["function"]["parameters"]["required"] == ["text"]


def test_vllm_mlx_shapes(served):
    """vllm-mlx's documented forms: tools with a count, servers, execute by tool_name."""
    body = httpx.get(served.url + "/v1/mcp/tools").json()
    assert body["count"] == len(body["tools"]) == len(body["data"])
    (echo,) = [t for t in body["tools"] if t["name"] == "echo"]
    assert echo["server"] == "calc" and echo["parameters"]["required"] == ["text"]
    servers = {s["name"]: s for s in httpx.get(served.url + "/v1/mcp/servers").json()["servers"]}
    assert servers["calc"]["tools_count"] == 2 and servers["calc"]["transport"] == "stdio"
    r = execute(served, tool_name="calc__add", arguments={"a": 2, "b": 3})
    assert r.json()["tool_name"] == "calc__add" and r.json()["text"] == "5"
    assert r.json()["is_error"] is False and r.json()["error_message"] is None
    r = execute(served, tool_name="echo", arguments={"text": "hi"})  # one server has it
    assert r.json()["text"] == "hi"
    r = execute(served, tool_name="add", arguments={"a": 1, "b": 1})  # two servers do
    assert r.status_code == 400 and r.json()["error"]["code"] == "ambiguous_tool"
    r = execute(served, tool_name="nope", arguments={})
    assert r.status_code == 404


def test_execute_and_its_errors(served):
    r = execute(served, server="calc", tool="add", arguments={"a": 2, "b": 3})
    assert r.status_code == 200 and r.json()["text"] == "5" and not r.json()["is_error"]
    r = execute(served, server="calc", tool="add", arguments={"a": "two"})
    assert r.status_code == 400 and "arguments" in r.json()["error"]["message"]
    r = execute(served, server="calc", tool="nope", arguments={})
    assert r.status_code == 404 and r.json()["error"]["code"] == "mcp_tool_not_found"
    r = execute(served, server="nope", tool="add", arguments={})
    assert r.status_code == 404 and r.json()["error"]["code"] == "mcp_server_not_found"
    r = execute(served, server="hanger", tool="wait", arguments={})
    assert r.status_code == 504 and r.json()["error"]["code"] == "mcp_timeout", r.text
    assert execute(served, server="calc", tool="echo",
                   arguments={"text": "still here"}).json()["text"] == "still here"
    big = execute(served, server="calc", tool="echo", arguments={"text": "x" * 5000}).json()
    assert big["truncated"] and len(big["text"]) == 1024  # MLXFLEET_MCP_MAX_RESULT_KB=1


def test_a_server_that_dies_is_restarted(served):
    before = status(served)["crasher"]["restarts"]
    r = execute(served, server="crasher", tool="add", arguments={"a": 1, "b": 1})
    assert r.status_code in (502, 503) and r.json()["error"]["message"]
    assert wait_for(lambda: status(served)["crasher"]["restarts"] > before
                    and state(served, "crasher") == "ready", 60)


def test_cli_lists_and_calls(served):
    env = {"MLXFLEET_SERVER": served.url}
    import os

    out = subprocess.run([sys.executable, "-m", "mlxfleet", "mcp", "list"], text=True,
                         capture_output=True, env={**os.environ, **env}, timeout=60)
    assert out.returncode == 0 and "calc" in out.stdout and "echo" in out.stdout
    out = subprocess.run([sys.executable, "-m", "mlxfleet", "mcp", "call", "calc", "add",
                          '{"a": 20, "b": 22}'], text=True, capture_output=True,
                         env={**os.environ, **env}, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "42"


def test_responses_mcp_tool_runs_the_models_calls_on_the_server(served):
    import openai

    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
    tool = {"type": "mcp", "server_label": "calc", "allowed_tools": ["add"],
            "require_approval": "never"}
    r = client.responses.create(
        model="tiny", input="add two numbers", tools=[tool], max_output_tokens=40,
        tool_choice={"type": "mcp", "server_label": "calc", "name": "add"})
    kinds = [o.type for o in r.output]
    assert kinds[0] == "mcp_list_tools" and "mcp_call" in kinds, kinds
    listed = r.output[0]
    assert [t.name for t in listed.tools] == ["add"] and listed.server_label == "calc"
    call = next(o for o in r.output if o.type == "mcp_call")
    args = json.loads(call.arguments)
    assert call.output == str(args["a"] + args["b"]) and call.error is None
    # Approval first, unless "never": the call is returned, not run.
    r = client.responses.create(
        model="tiny", input="add", max_output_tokens=40,
        tools=[{**tool, "require_approval": "always"}],
        tool_choice={"type": "mcp", "server_label": "calc", "name": "add"})
    assert [o.type for o in r.output] == ["mcp_list_tools", "mcp_approval_request"]
    for bad in ({**tool, "server_label": "nope"},
                {**tool, "server_url": "https://evil.example/mcp"}):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="tiny", input="x", tools=[bad])


def test_the_settings_files_mcp_key_configures_servers_too(tmp_path):
    import yaml

    from mlxfleet.serve import _mcp_manager
    from mlxfleet.settings import load_settings

    cfg = tmp_path / "mlxfleet.yaml"
    cfg.write_text(yaml.safe_dump({"mcp": {"mcpServers": {
        "calc": {"command": sys.executable, "args": ["calc.py"]},
        "shell": {"command": "sh", "args": ["-c", "echo hi"]}}}}))
    m = _mcp_manager(load_settings(config_file=str(cfg), manifests_dir=str(tmp_path)))
    assert set(m.servers) == {"calc", "shell"}
    assert m.servers["calc"].state == "starting"  # (not started: no event loop here)
    assert m.servers["shell"].state == "invalid" and "allowed" in m.servers["shell"].error


def test_a_streamable_http_server(tmp_path):
    from conftest import free_port

    port = free_port()
    (tmp_path / "remote.py").write_text(
        "from mcp.server.mcpserver import MCPServer\napp = MCPServer('remote')\n"
        "@app.tool()\ndef shout(text: str) -> str:\n    return text.upper()\n"
        f"app.run(transport='streamable-http', port={port})\n")
    server = subprocess.Popen([sys.executable, str(tmp_path / "remote.py")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (tmp_path / "mcp.json").write_text(json.dumps({"mcpServers": {
        "remote": {"url": f"http://127.0.0.1:{port}/mcp"}}}))
    f = Served(tmp_path, env={"MLXFLEET_MCP_CONFIG": str(tmp_path / "mcp.json")})
    try:
        f.start()
        assert wait_for(lambda: state(f, "remote") == "ready", 60), status(f)
        assert status(f)["remote"]["transport"] == "http"
        r = execute(f, server="remote", tool="shout", arguments={"text": "hi"})
        assert r.status_code == 200 and r.json()["text"] == "HI"
    finally:
        f.stop()
        server.terminate()
        server.wait(20)


def test_no_orphans_when_the_server_stops(tmp_path, served):
    """Last in the file: it stops the module's server."""
    import psutil

    kids = [p for p in psutil.Process(served.proc.pid).children(recursive=True)
            if "calc.py" in " ".join(p.cmdline())]
    assert kids
    served.stop()
    assert wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                    for p in kids), 20)
