"""The ``mlxfleet`` command line.

Over 400 lines on purpose: every subcommand's arguments and its few lines of
printing sit together, so ``mlxfleet --help`` and the code read the same way;
the work itself lives in the modules each command calls.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Optional

from .cli_fleet import add_fleet_commands, run_fleet
from .cli_store import add_store_commands
from .units import fmt_age, fmt_bytes


def _default_name(source: str) -> str:
    base = source.split(":", 1)[-1].rstrip("/").split("/")[-1]
    return re.sub(r"[^a-z0-9-]+", "-", base.lower()).strip("-") or "model"


#: ``mlxfleet worker`` flags -> WorkerConfig fields (defaults live in WorkerConfig only).
def _add_worker(sub) -> None:
    from .worker_settings import SETTINGS, default

    p = sub.add_parser("worker", help="run one model worker in the foreground",
                       description="Serve one MLX model over the OpenAI API. Flags override "
                       "--config; unset ones take the worker's defaults.")
    p.add_argument("--config", help="the whole configuration as JSON (what the supervisor "
                   "passes), or @FILE")
    p.add_argument("--source", help="builtin:NAME, a local model directory, or a Hugging "
                   "Face repo id")
    p.add_argument("--name", help="model name clients send as `model` (default: from source)")
    p.add_argument("--bind", default="127.0.0.1:8001",
                   help="unix:PATH or HOST:PORT (default 127.0.0.1:8001)")
    p.add_argument("--cache-mb", type=int, default=None,
                   help="KV memory budget in MiB: running sequences plus retained prompt "
                   f"caches (default {default('cache_bytes') >> 20})")
    p.add_argument("--cache-percent", type=float, default=None,
                   help="KV memory budget as a share (0-1) of physical memory")
    for row in SETTINGS:  # every other flag, from the worker settings' table
        if row.flag is None:
            continue
        shown = f" (default {row.default})" \
            if row.default not in (None, False) and not isinstance(row.type, tuple) else ""
        if row.type is bool:
            p.add_argument(row.flag, action="store_true", default=None, dest=row.field,
                           help=row.help)
        elif isinstance(row.type, tuple):
            p.add_argument(row.flag, choices=row.type, type=type(row.type[0]), default=None,
                           dest=row.field, help=row.help + shown)
        else:
            p.add_argument(row.flag, type=row.type, default=None, dest=row.field,
                           help=row.help + shown)


def worker_config_from_args(args):
    """The WorkerConfig for ``mlxfleet worker``: --config, then the flags given."""
    from .worker_settings import SETTINGS, WorkerConfig, cache_budget

    base: dict = {}
    if args.config:
        text = args.config
        if text.startswith("@"):
            text = Path(text[1:]).read_text()
        base = json.loads(text)
    given = {row.field for row in SETTINGS if row.flag is not None} | {"source", "name"}
    base.update({k: getattr(args, k) for k in given if getattr(args, k) is not None})
    if args.cache_mb is not None or args.cache_percent is not None:
        base["cache_bytes"] = cache_budget(args.cache_mb, args.cache_percent)
    if "source" in base and "name" not in base:
        base["name"] = _default_name(base["source"])
    return WorkerConfig(**base)


def _run_worker(args) -> int:
    from pydantic import ValidationError

    from .blas import preload_blas

    try:
        config = worker_config_from_args(args)
    except (ValidationError, ValueError, OSError) as e:
        print(f"error: invalid worker configuration: {e}", file=sys.stderr)
        return 2
    preload_blas()  # before anything imports mlx
    from .worker.server import run_worker

    return run_worker(config, args.bind)


def _run_make_model(args) -> int:
    from .builtin import BUILTIN_NAMES, BUILTIN_PREFIX, write_builtin

    name = args.source[len(BUILTIN_PREFIX):] if args.source.startswith(BUILTIN_PREFIX) \
        else args.source
    if name not in BUILTIN_NAMES:
        print(f"error: unknown builtin model {args.source!r}; choose one of: "
              + ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_NAMES), file=sys.stderr)
        return 2
    out = write_builtin(name, Path(args.dir))
    print(f"wrote {BUILTIN_PREFIX}{name} to {out}")
    return 0


def _add_server_commands(sub) -> None:
    p = sub.add_parser("serve", help="run the supervisor and gateway in the foreground",
                       description="Reconcile a folder of Model manifests into workers "
                       "behind one OpenAI-compatible port. With SOURCE, serve just that "
                       "model (like `vllm-mlx serve MODEL`).")
    p.add_argument("source", nargs="?", help="quick start: serve one model from this source")
    p.add_argument("--manifests", dest="manifests_dir", help="manifests folder (./manifests)")
    p.add_argument("--host", help="address to bind (127.0.0.1)")
    p.add_argument("--port", type=int, help="port (8000)")
    p.add_argument("--state-dir", help="where logs and state go")
    p.add_argument("--config", dest="config_file", help="YAML settings file")
    p.add_argument("--name", help="with SOURCE: the model's name")
    p.add_argument("--api-key", help="require this key (comma-separate several)")
    p.add_argument("--admin-key", help="key(s) for apply, delete, load and unload "
                   "(default: the API keys)")
    p.add_argument("--insecure", action="store_true", default=None,
                   help="allow a non-loopback bind without an API key")
    p.add_argument("--node", help="fleets: this machine's name (a kind: Node manifest in "
                   "the folder); unset: a single machine")
    p.add_argument("--fleet-key", help="fleets: the shared key nodes send each other "
                   "(MLXFLEET_FLEET_KEY)")
    p.add_argument("--rate-limit", type=int, help="requests per minute per client")
    p.add_argument("--timeout", type=float, help="request timeout in seconds (300)")
    p.add_argument("--max-body-mb", type=int, help="largest request body (32)")
    p.add_argument("--enable-metrics", action="store_true", default=None,
                   help="serve Prometheus /metrics (unauthenticated)")
    p.add_argument("--max-tokens", type=int, help="completion length when a request sets "
                   "no max_tokens, for models whose manifest sets none")
    p.add_argument("--max-request-tokens", type=int, help="the largest max_tokens a request "
                   "may ask for, for models whose manifest sets none")
    p.add_argument("--max-prompt-tokens", type=int, help="the longest prompt in tokens, for "
                   "models whose manifest sets none")
    p.add_argument("--default-temperature", type=float)
    p.add_argument("--default-top-p", type=float)
    p.add_argument("--stream-interval", type=int, help="tokens per streamed chunk")
    p.add_argument("--log-json", action="store_true", default=None, help="JSON log lines")
    v = p.add_argument_group("vllm-mlx options", "vllm-mlx's flags, with its meanings; "
                             "each also has a manifest field and a server setting")
    v.add_argument("--continuous-batching", action="store_true",
                   help="accepted: continuous batching is always on")
    v.add_argument("--use-paged-cache", action="store_true", default=None,
                   help="keep prompts as shared 64-token KV blocks (spec.cache.paged)")
    v.add_argument("--cache-memory-mb", type=int, dest="default_cache_mb",
                   help="each model's KV / prompt-cache budget in MiB (spec.cache.memoryMB)")
    v.add_argument("--cache-memory-percent", type=float, dest="default_cache_percent",
                   help="the same as a share (0-1) of RAM; with SOURCE and neither flag, "
                   "0.20 as in vllm-mlx")
    v.add_argument("--tool-call-parser", help="tool-call format (spec.parsers.toolCall)")
    v.add_argument("--reasoning-parser", help="qwen3 or deepseek_r1 (spec.parsers.reasoning)")
    v.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                   help="parse tool calls (with SOURCE, off without this flag or a parser, "
                   "as in vllm-mlx)")
    v.add_argument("--embedding-model", metavar="SOURCE",
                   help="with SOURCE: also serve this embedding model, preloaded")
    v.add_argument("--mcp-config", metavar="FILE", help="MCP servers to start with the "
                   "gateway (the mcpServers JSON desktop assistants use); /v1/mcp routes")

    g = sub.add_parser("get", help="list models, nodes or the sources on disk: mlxfleet get "
                       "models|nodes|sources")
    g.add_argument("what", choices=["models", "model", "nodes", "node", "sources", "source"])
    g.add_argument("-o", "--output", choices=["table", "json", "wide"], default="table")
    d = sub.add_parser("describe", help="show one model's or node's status: mlxfleet "
                       "describe model|node NAME")
    d.add_argument("what", choices=["model", "node"])
    d.add_argument("name")
    lg = sub.add_parser("logs", help="print a model's worker log")
    lg.add_argument("name")
    lg.add_argument("-f", "--follow", action="store_true")
    lg.add_argument("--tail", type=int, default=100)
    a = sub.add_parser("apply", help="validate a manifest file and install it")
    a.add_argument("-f", "--filename", required=True, help="manifest file (- for stdin)")
    dl = sub.add_parser("delete", help="remove a model's manifest: mlxfleet delete model NAME")
    dl.add_argument("what", choices=["model"])
    dl.add_argument("name")
    for q in (g, d, lg, a, dl):
        q.add_argument("--server", default=None,
                       help="gateway URL (MLXFLEET_SERVER, else http://127.0.0.1:8000)")
    ld = sub.add_parser("load", help="load a model now: mlxfleet load NAME")
    ld.add_argument("name")
    ul = sub.add_parser("unload", help="unload a model after its in-flight requests finish")
    ul.add_argument("name")
    for q in (ld, ul):
        q.add_argument("--server", default=None, help="gateway URL")
    mc = sub.add_parser("mcp", help="MCP tool servers: mcp list | mcp call SERVER TOOL JSON")
    mc.add_argument("action", choices=["list", "call"])
    mc.add_argument("server_name", nargs="?")
    mc.add_argument("tool", nargs="?")
    mc.add_argument("arguments", nargs="?", default="{}", help="the tool's arguments (JSON)")
    mc.add_argument("--server", default=None, help="gateway URL")
    b = sub.add_parser("bench", help="load-test an OpenAI-compatible server",
                       description="N concurrent streaming clients with fixed prompt and "
                       "output lengths; reports tokens/s, requests/s, TTFT and inter-token "
                       "latency percentiles, errors.")
    b.add_argument("--url", default=None, help="server URL (default: MLXFLEET_SERVER or "
                   "http://127.0.0.1:8000)")
    b.add_argument("--uds", help="connect over this Unix socket instead")
    b.add_argument("--model", default="default")
    b.add_argument("-c", "--concurrency", type=int, default=8)
    b.add_argument("-n", "--requests", type=int, default=None,
                   help="total requests (default 2 x concurrency)")
    b.add_argument("--prompt-words", type=int, default=64)
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--completions", action="store_true", help="use /v1/completions")
    b.add_argument("--json", action="store_true", help="print the report as JSON")
    la = sub.add_parser("launch", help="start an agent client (claude, codex, opencode) "
                        "pointed at this server", description="Start Claude Code, Codex or "
                        "opencode with what it needs to use this server (its base URL, a "
                        "key, a model), as `ollama launch` does; nothing is written into "
                        "their own config files. Arguments after -- go to the client: "
                        "mlxfleet launch claude -- -p 'hello'.")
    la.add_argument("client", choices=["claude", "codex", "opencode"])
    la.add_argument("--model", default=None, help="the model name the client sends (default: "
                    "one the bundled manifests alias: claude-sonnet-4-5, gpt-5.5, default)")
    la.add_argument("--print", action="store_true", help="print the settings and the "
                    "command instead of starting the client")
    la.add_argument("--server", default=None, help="gateway URL")
    v = sub.add_parser("validate", help="check manifest files without a server")
    v.add_argument("paths", nargs="+")
    sub.add_parser("schema", help="print the manifest JSON Schema")


def _run_serve(args) -> int:
    import tempfile

    from pydantic import ValidationError

    from .serve import serve
    from .settings import load_settings

    try:
        flags = dict(
            host=args.host, port=args.port, manifests_dir=args.manifests_dir,
            state_dir=args.state_dir, config_file=args.config_file, api_key=args.api_key,
            admin_key=args.admin_key, node=args.node, fleet_key=args.fleet_key,
            insecure=args.insecure, rate_limit=args.rate_limit, timeout=args.timeout,
            max_body_mb=args.max_body_mb, enable_metrics=args.enable_metrics,
            max_tokens=args.max_tokens, max_request_tokens=args.max_request_tokens,
            max_prompt_tokens=args.max_prompt_tokens,
            default_temperature=args.default_temperature, default_top_p=args.default_top_p,
            stream_interval=args.stream_interval, log_json=args.log_json,
            default_cache_mb=args.default_cache_mb,
            default_cache_percent=args.default_cache_percent,
            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            use_paged_cache=args.use_paged_cache, mcp_config=args.mcp_config)
        if args.source:
            flags.update(_quick_start_defaults(args))
        settings = load_settings(**flags)
    except (ValidationError, FileNotFoundError, ValueError) as e:
        print(f"error: invalid settings: {e}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(settings.log_level.upper())
    if settings.log_json:
        _json_logs()
    if args.embedding_model and not args.source:
        print("error: --embedding-model goes with SOURCE; in a manifests folder, add a "
              "manifest with spec.task: embedding", file=sys.stderr)
        return 2
    if args.source:
        if args.manifests_dir:
            print("error: give either SOURCE or --manifests, not both", file=sys.stderr)
            return 2
        name = args.name or _default_name(args.source)
        folder = Path(tempfile.mkdtemp(prefix="mlxfleet-quick-"))
        (folder / f"{name}.yaml").write_text(
            "apiVersion: mlxfleet/v1\nkind: Model\n"
            f"metadata: {{name: {json.dumps(name)}}}\n"
            f"spec: {{source: {json.dumps(args.source)}, aliases: [default], "
            "preload: true, keepAlive: forever}\n")
        if args.embedding_model:
            emb = _default_name(args.embedding_model)
            if emb == name:
                emb += "-embed"
            (folder / f"{emb}.yaml").write_text(
                "apiVersion: mlxfleet/v1\nkind: Model\n"
                f"metadata: {{name: {json.dumps(emb)}}}\n"
                f"spec: {{source: {json.dumps(args.embedding_model)}, task: embedding, "
                "preload: true, keepAlive: forever}\n")
            print(f"embedding model: {args.embedding_model} as '{emb}'", file=sys.stderr)
        settings.manifests_dir = folder
    from .event_loop import run_loop

    run_loop(serve(settings))
    return 0


def _quick_start_defaults(args) -> dict:
    """``serve SOURCE`` behaves as ``vllm-mlx serve`` does where flags are not given:
    32768 tokens by default and at most (clipped to the context), a KV budget of 20% of
    RAM, tool calls parsed only with --enable-auto-tool-choice or a parser."""
    out: dict = {}
    if args.max_tokens is None:
        out["max_tokens"] = 32768
    if args.max_request_tokens is None:
        out["max_request_tokens"] = 32768
    if args.default_cache_mb is None and args.default_cache_percent is None:
        out["default_cache_percent"] = 0.20
    if args.enable_auto_tool_choice is None and args.tool_call_parser is None:
        out["enable_auto_tool_choice"] = False
    return out


def _json_logs() -> None:
    """One JSON object per log line (for log shippers)."""

    class JsonFormatter(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return json.dumps({"time": self.formatTime(record), "level": record.levelname,
                               "logger": record.name, "message": record.getMessage()})

    for h in logging.getLogger().handlers:
        h.setFormatter(JsonFormatter())


def _server_url(args) -> str:
    return (args.server or os.environ.get("MLXFLEET_SERVER")
            or f"http://127.0.0.1:{os.environ.get('MLXFLEET_PORT', '8000')}").rstrip("/")


def _cli_key(prefer: tuple[str, ...] = ("MLXFLEET_ADMIN_KEY", "MLXFLEET_API_KEY")) -> str:
    """The key the CLI sends: the admin key when set (control writes need it), else a
    client key; the first of ``prefer`` that is set."""
    for var in prefer:
        key = os.environ.get(var, "").split(",")[0].strip()
        if key:
            return key
    return ""


def _api(args, method: str, path: str, prefix: str = "/mlxfleet/v1", **kw):
    import httpx

    url = _server_url(args)
    try:
        kw.setdefault("timeout", 30)
        key = _cli_key()
        if key:
            kw.setdefault("headers", {})["Authorization"] = f"Bearer {key}"
        r = httpx.request(method, url + prefix + path, **kw)
    except httpx.ConnectError:
        raise SystemExit(f"error: no mlxfleet server at {url} (start one with "
                         "`mlxfleet serve`, or pass --server)") from None
    if r.status_code >= 400:
        try:
            err = r.json()["error"]
            msg = err["message"]
            details = err.get("details") or []
        except (ValueError, KeyError, TypeError):
            msg, details = r.text, []
        lines = details or [msg]
        raise SystemExit("error: " + "\n  ".join(lines))
    return r


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _run_get(args) -> int:
    if args.what in ("nodes", "node"):
        return _run_get_nodes(args)
    if args.what in ("sources", "source"):
        from .cli_store import print_sources

        print_sources(_api(args, "GET", "/sources").json(), args.output)
        return 0
    data = _api(args, "GET", "/models").json()
    if args.output == "json":
        print(json.dumps(data, indent=2))
        return 0
    rows = [["NAME", "SOURCE", "STATE", "READY", "RESTARTS", "MEMORY", "AGE"]]
    if args.output == "wide":
        rows[0] += ["NODE", "PID", "EST. MEMORY", "KEEP-ALIVE", "LAST USED", "EXPIRES",
                    "ALIASES"]
    for m in data["items"]:
        reps = m.get("replicas")  # a replicated model: its copies, ready of asked for
        ready = f"{reps['ready']}/{reps['desired']}" if reps else \
            ("1/1" if m["ready"] else "0/1")
        phase = "Degraded" if reps and reps["reason"] and reps["ready"] else m["phase"]
        row = [m["name"], m["source"], phase, ready,
               str(m["restarts"]), fmt_bytes(m["memoryBytes"]), fmt_age(m["ageSeconds"])]
        if args.output == "wide":
            ka = m["keepAlive"]
            where = ",".join(f"{i['node']}:{i['phase']}" for i in reps["items"]) if reps \
                else m.get("node") or ("-" if m["phase"] == "Unschedulable" else "local")
            row += [where,
                    str(m["pid"] or "-"), fmt_bytes(m["memory"]["footprintBytes"]),
                    ka if isinstance(ka, str) else f"{ka:g}s", m["lastUsed"] or "-",
                    m["expiresAt"] or "-", ",".join(m["aliases"]) or "-"]
        rows.append(row)
    print(_table(rows) if len(rows) > 1 else "No models.")
    mem = data.get("memory")
    if mem:
        print(f"\nmemory: {fmt_bytes(mem['usedBytes'])} used of "
              f"{fmt_bytes(mem['budgetBytes'])} budget ({mem.get('budgetSource', 'set')}), "
              f"{fmt_bytes(max(mem['freeBytes'], 0))} free")
    for errs in data.get("manifestErrors", {}).values():
        for e in errs:
            print(f"manifest error: {e}", file=sys.stderr)
    return 0


def _nodes(args) -> list[dict]:
    data = _api(args, "GET", "/nodes").json()
    if not data["items"]:
        raise SystemExit("error: this server is not a node of a fleet (it was started "
                         "without --node)")
    return data["items"]


def _run_get_nodes(args) -> int:
    items = _nodes(args)
    if args.output == "json":
        print(json.dumps(items, indent=2))
        return 0
    rows = [["NAME", "URL", "STATUS", "MODELS", "MEMORY", "LABELS", "AGE"]]
    if args.output == "wide":
        rows[0] += ["DEVICE", "CHIP", "VERSION", "LAST SEEN"]
    for n in items:
        mem = n["memory"]
        age = "-"
        if n["startedAt"]:
            from datetime import datetime

            started = datetime.fromisoformat(n["startedAt"].replace("Z", "+00:00"))
            age = fmt_age((datetime.now(started.tzinfo) - started).total_seconds())
        row = [n["name"] + (" (this)" if n["self"] else ""), n["url"], n["status"],
               str(len(n["models"])),
               f"{fmt_bytes(mem['usedBytes'])}/{fmt_bytes(mem['capacityBytes'])}",
               ",".join(f"{k}={v}" for k, v in n["labels"].items()) or "-", age]
        if args.output == "wide":
            seen = n["lastSeenSecondsAgo"]
            dev = n.get("accelerator") or {}
            row += [f"{dev['kind']}: {dev['name']}" if dev.get("kind") not in (None, "cpu")
                    else dev.get("kind") or "-", n["chip"] or "-", n["version"] or "-",
                    "-" if seen is None else f"{seen:g}s ago"]
        rows.append(row)
    print(_table(rows))
    return 0


def _run_describe_node(args) -> int:
    items = {n["name"]: n for n in _nodes(args)}
    n = items.get(args.name)
    if n is None:
        raise SystemExit(f"error: no node named {args.name!r}. Known: {', '.join(items)}.")
    mem = n["memory"]
    seen = n["lastSeenSecondsAgo"]
    print(f"Name:          {n['name']}{' (the node answering)' if n['self'] else ''}")
    print(f"URL:           {n['url']}")
    print(f"Status:        {n['status']}" + (f" ({n['error']})" if n["error"] else ""))
    print(f"Labels:        {', '.join(f'{k}={v}' for k, v in n['labels'].items()) or '-'}")
    print(f"Chip:          {n['chip'] or '-'} ({n['system'] or '-'})")
    print(f"Version:       {n['version'] or '-'}")
    print(f"Started:       {n['startedAt'] or '-'}")
    print(f"Last seen:     {'-' if seen is None else f'{seen:g}s ago'}")
    print(f"Memory:        {fmt_bytes(mem['usedBytes'])} used of "
          f"{fmt_bytes(mem['capacityBytes'])} (machine {fmt_bytes(mem['totalBytes'])})")
    print(f"Models:        {', '.join(n['models']) or '-'}")
    return 0


def _run_describe(args) -> int:
    if args.what == "node":
        return _run_describe_node(args)
    m = _api(args, "GET", f"/models/{args.name}").json()
    print(f"Name:          {m['name']}")
    print(f"Node:          {m.get('node') or '-'}")
    print(f"Source:        {m['source']}")
    print(f"Aliases:       {', '.join(m['aliases']) or '-'}")
    print(f"Labels:        {', '.join(f'{k}={v}' for k, v in m['labels'].items()) or '-'}")
    print(f"File:          {m['file']}")
    print(f"Phase:         {m['phase']}")
    print(f"Generation:    {m['generation']} (observed {m['observedGeneration']})")
    print(f"PID:           {m['pid'] or '-'}")
    print(f"Memory:        {fmt_bytes(m['memoryBytes'])}")
    print(f"Restarts:      {m['restarts']}")
    ka = m["keepAlive"]
    print(f"Keep-alive:    {ka if isinstance(ka, str) else f'{ka:g}s'}"
          f"{' (pinned)' if m['pinned'] else ''}, priority {m['priority']}")
    print(f"Last used:     {m['lastUsed'] or '-'}   expires: {m['expiresAt'] or '-'}")
    mm = m["memory"]
    print(f"Est. memory:   {fmt_bytes(mm['footprintBytes'])} "
          f"(weights {fmt_bytes(mm['weightBytes'])}, "
          f"KV cache {fmt_bytes(mm['cacheBytes'])}; measured {fmt_bytes(mm['measuredBytes'])})")
    paths = m.get("paths") or {}
    if paths:
        p = paths.get("parsers") or {}
        print(f"Architecture:  {paths.get('model_type')} ({', '.join(paths.get('caches', []))})")
        print(f"Parsers:       tool calls {p.get('tool_call')}, reasoning "
              f"{p.get('reasoning') or '-'} (from the {p.get('source')})")
        print(f"Exact paths:   prefill {paths.get('prefill')}; prefix reuse "
              f"{paths.get('prefix_reuse')}")
        print(f"KV cache:      {paths.get('kv_cache') or '-'}; speculation "
              f"{paths.get('speculation') or '-'}")
    pull = m.get("pull")
    if pull:
        total = pull["totalBytes"]
        print(f"Pulling:       {fmt_bytes(pull['completedBytes'])}"
              + (f" of {fmt_bytes(total)} ({pull['completedBytes'] * 100 // total}%)"
                 if total else "") + f", {fmt_bytes(pull['bytesPerSecond'])}/s")
    print(f"Last error:    {m['lastError'] or '-'}")
    print(f"Log:           {m['logFile']}")
    print("Conditions:")
    rows = [["  TYPE", "STATUS", "REASON", "MESSAGE"]]
    rows += [["  " + c["type"], c["status"], c["reason"], c["message"]]
             for c in m["conditions"]]
    print(_table(rows))
    print("Events:")
    if not m["events"]:
        print("  <none>")
    for e in m["events"][-15:]:
        print(f"  {e['time']}  {e['type']:<8} {e['reason']:<16} {e['message']}")
    return 0


def _run_logs(args) -> int:
    import httpx

    params = {"tail": str(args.tail), "follow": "1" if args.follow else "0"}
    if not args.follow:
        sys.stdout.write(_api(args, "GET", f"/models/{args.name}/logs", params=params).text)
        return 0
    _api(args, "GET", f"/models/{args.name}")  # a clear error for an unknown name
    url = _server_url(args) + f"/mlxfleet/v1/models/{args.name}/logs"
    try:
        key = _cli_key()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with httpx.stream("GET", url, params=params, timeout=None, headers=headers) as r:
            for chunk in r.iter_text():
                sys.stdout.write(chunk)
                sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    return 0


def _run_apply(args) -> int:
    if args.filename == "-":
        text, fname = sys.stdin.read(), "<stdin>"
    else:
        try:
            text, fname = Path(args.filename).read_text(encoding="utf-8"), args.filename
        except OSError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    r = _api(args, "POST", "/manifests", content=text.encode(), params={"filename": fname},
             headers={"Content-Type": "application/yaml"})
    for a in r.json()["applied"]:
        print(f"model/{a['name']} {a['action']} ({a['file']})")
    return 0


def _run_load(args) -> int:
    m = _api(args, "POST", f"/models/{args.name}/load", timeout=None).json()
    print(f"model/{m['name']} loaded (pid {m['pid']}, {fmt_bytes(m['memoryBytes'])})")
    return 0


def _run_unload(args) -> int:
    m = _api(args, "POST", f"/models/{args.name}/unload", timeout=None).json()
    print(f"model/{m['name']} unloaded")
    return 0


def _run_pull(args) -> int:
    from .cli_store import run_pull

    key = _cli_key()
    return run_pull(args, _server_url(args), {"Authorization": f"Bearer {key}"} if key else {})


def _run_rm(args) -> int:
    r = _api(args, "DELETE", "/sources", params={"source": args.source}).json()
    print(f"source/{r['source']} deleted ({fmt_bytes(r['freedBytes'])} freed)")
    return 0


def _run_delete(args) -> int:
    r = _api(args, "DELETE", f"/models/{args.name}").json()
    print(f"model/{r['deleted']} deleted ({r['file']})")
    return 0


def _run_bench(args) -> int:
    import asyncio

    from .bench import format_report, run_bench

    url = args.url or os.environ.get("MLXFLEET_SERVER") or "http://127.0.0.1:8000"
    if args.uds:
        url = "http://worker"
    n = args.requests or 2 * args.concurrency
    report = asyncio.run(run_bench(url, args.model, args.concurrency, n, args.prompt_words,
                                   args.max_tokens, chat=not args.completions, uds=args.uds))
    s = report.summary()
    print(json.dumps(s, indent=2) if args.json else format_report(s))
    return 1 if s["errors"] == n else 0


def _run_launch(args) -> int:
    from .launch import plan, run

    config_dir = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") \
        / "mlxfleet" / "launch"
    # an agent is given a client key (it never needs to change models), else the admin's
    key = _cli_key(("MLXFLEET_API_KEY", "MLXFLEET_ADMIN_KEY"))
    launch = plan(args.client, _server_url(args), key, args.model, args.extra, config_dir)
    if args.print:
        print(launch.shell())
        return 0
    return run(launch)


def _run_validate(args) -> int:
    from .manifest import load_paths

    paths = [Path(p) for p in args.paths]
    missing = [p for p in paths if not p.exists()]
    if missing:
        for p in missing:
            print(f"error: {p}: no such file or directory", file=sys.stderr)
        return 1
    bad = 0
    for r in load_paths(paths):
        if r.errors:
            bad += 1
            for e in r.errors:
                print(f"error: {e}", file=sys.stderr)
        else:
            names = ", ".join([lm.manifest.name for lm in r.models]
                              + [f"node {n.name}" for n in r.nodes]) or "no models"
            print(f"ok: {r.file} ({names})")
    return 1 if bad else 0


def _run_schema(args) -> int:
    from .manifest import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def _run_mcp(args) -> int:
    if args.action == "list":
        status = _api(args, "GET", "/mcp/status", prefix="/v1").json()["servers"]
        tools = _api(args, "GET", "/mcp/tools", prefix="/v1").json()["data"]
        rows = [["SERVER", "STATE", "TOOLS", "ERROR"]] + [
            [s["name"], s["state"], str(s["tools"]), s["last_error"] or "-"] for s in status]
        print(_table(rows) if len(rows) > 1 else "No MCP servers.")
        for t in tools:
            print(f"  {t['server']}/{t['tool']}: {t['function']['description']}")
        return 0
    if not (args.server_name and args.tool):
        raise SystemExit("error: mcp call SERVER TOOL '{\"arg\": ...}'")
    try:
        arguments = json.loads(args.arguments)
    except ValueError as e:
        raise SystemExit(f"error: the arguments are not JSON: {e}") from None
    r = _api(args, "POST", "/mcp/execute", prefix="/v1", timeout=None, json={
        "server": args.server_name, "tool": args.tool, "arguments": arguments}).json()
    print(r["text"] if r["text"] else json.dumps(r["content"], indent=2))
    return 1 if r["is_error"] else 0


def _run_service(args) -> int:
    from . import service
    from .settings import default_state_dir

    state = Path(args.state_dir).expanduser().resolve() if args.state_dir else \
        default_state_dir()
    extra = ["--config", str(Path(args.config).resolve())] if args.config else []
    svc = service.make(Path(args.manifests), args.port, args.host, args.system, state, extra)
    if args.action == "print":
        print(f"# {svc.path}")
        sys.stdout.write(svc.text.decode())
        return 0
    if args.action == "install":
        return service.install(svc, state, args.dry_run)
    if args.action == "uninstall":
        return service.uninstall(svc, args.dry_run)
    return service.run([svc.status], args.dry_run)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mlxfleet",
                                     description="Serve local LLMs with MLX from YAML manifests.")
    parser.add_argument("--log-level", default=os.environ.get("MLXFLEET_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)
    _add_server_commands(sub)
    _add_worker(sub)
    add_store_commands(sub)
    add_fleet_commands(sub)
    sv = sub.add_parser("service", help="run the server at login or boot (launchd/systemd)",
                        description="Install mlxfleet serve as a launchd agent (macOS) or a "
                        "systemd user unit (Linux); --system: a LaunchDaemon / system unit "
                        "that runs before anyone logs in (needs root).")
    sv.add_argument("action", choices=["install", "uninstall", "status", "print"])
    sv.add_argument("--system", action="store_true")
    sv.add_argument("--manifests", default="./manifests", help="manifests folder (./manifests)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--state-dir", default=None, help="logs and state (the default state dir)")
    sv.add_argument("--config", default=None, help="a settings file for the server (keep "
                    "API keys there, mode 0600: they are not written into the service file)")
    sv.add_argument("--dry-run", action="store_true", help="print, change nothing")
    p = sub.add_parser("make-model", help="write a builtin model to a directory")
    p.add_argument("source", help="builtin:tiny, builtin:tiny-10m, builtin:tiny-50m, "
                   "builtin:demo")
    p.add_argument("dir", help="output directory")
    argv = list(sys.argv[1:] if argv is None else argv)
    tail: list[str] = []
    if "launch" in argv and "--" in argv:  # the client's own arguments, untouched
        cut = argv.index("--")
        argv, tail = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    args.extra = tail
    quiet = args.command not in ("serve", "worker")  # client commands print, not log
    logging.basicConfig(level="WARNING" if quiet else args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2"):  # a line per request (huggingface_hub uses httpx2)
        logging.getLogger(noisy).setLevel(logging.WARNING)
    commands = {"worker": _run_worker, "make-model": _run_make_model, "serve": _run_serve,
                "get": _run_get, "describe": _run_describe, "logs": _run_logs,
                "apply": _run_apply, "delete": _run_delete, "load": _run_load,
                "unload": _run_unload, "validate": _run_validate, "bench": _run_bench,
                "schema": _run_schema, "service": _run_service, "mcp": _run_mcp,
                "launch": _run_launch, "pull": _run_pull, "rm": _run_rm,
                "fleet": run_fleet}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
