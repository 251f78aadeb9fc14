"""Server settings: command-line flags override ``MLXFLEET_*`` environment variables,
which override an optional YAML settings file (``--config`` or ``MLXFLEET_CONFIG``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "mlxfleet"


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MLXFLEET_", extra="forbid")

    host: str = Field("127.0.0.1", description="address the gateway binds")
    port: int = Field(8000, ge=0, le=65535)
    manifests_dir: Path = Field(Path("manifests"), description="folder of Model manifests")
    state_dir: Path = Field(default_factory=default_state_dir,
                            description="logs and other state")
    log_level: str = "INFO"
    startup_timeout: float = Field(600.0, gt=0, description="seconds a worker may take to load")
    drain_timeout: float = Field(30.0, ge=0,
                                 description="seconds in-flight requests get on stop/replace")
    stop_timeout: float = Field(10.0, gt=0, description="seconds after SIGTERM before SIGKILL")
    backoff_base: float = Field(1.0, gt=0, description="first crash-restart delay, seconds")
    backoff_cap: float = Field(60.0, gt=0, description="longest crash-restart delay")
    stable_period: float = Field(60.0, gt=0,
                                 description="seconds Ready that reset the crash backoff")
    reload_debounce_ms: int = Field(300, ge=0, description="changes to the manifests folder "
                                    "closer together than this are read as one")
    spec_settle_ms: int = Field(1000, ge=0, description="a changed spec must stay unchanged "
                                "this long before a worker starts for it (a burst of saves "
                                "starts one worker, not one per save)")
    health_interval: float = Field(5.0, gt=0, description="seconds between health checks of "
                                   "a ready worker (each may take as long)")
    health_failures: int = Field(3, ge=1, description="failed health checks in a row that "
                                 "get a worker killed and restarted")
    allow_worker_env: list[str] = Field(
        default_factory=list, description="environment variables manifests may set in spec.env "
        "although they change how code is loaded (LD_*, DYLD_*, PYTHON*, PATH): names, or "
        "prefixes ending in *")
    max_manifest_bytes: int = Field(1 << 20, gt=0, description="larger manifest files are "
                                    "refused with an error, unread")
    request_wait_timeout: float = Field(
        300.0, gt=0, description="seconds a request waits for its model to become ready")
    sse_keepalive_interval: float = Field(
        2.0, gt=0, description="seconds between SSE comment lines while a model loads")
    busy_wait_timeout: float = Field(
        60.0, ge=0, description="seconds a load waits for busy models to go idle when only "
        "they could make room")
    keep_alive: str = Field("5m", description="idle time before a model unloads, when its "
                            "manifest sets none: 30s, 5m, 1h, 0, -1/forever")
    memory_budget: str = Field("auto", description="memory all loaded models may use: "
                               "bytes (12GB, 512MiB), a share of physical memory (70%), or "
                               "auto: Metal's recommended working set on Apple Silicon, 70% "
                               "of physical memory elsewhere")
    wired_limit: Optional[str] = Field(None, description="macOS: each worker's Metal wired "
                                       "memory limit (bytes or a share of physical memory); "
                                       "unset: the system's, never raised by default")
    max_loaded_models: int = Field(0, ge=0, description="0 = no limit")
    worker_overhead_mb: int = Field(300, ge=0, description="memory a worker needs beyond "
                                    "weights and KV cache, until measured")
    default_cache_mb: int = Field(1024, gt=0, description="KV budget of a model whose "
                                  "manifest sets none")
    api_key: Optional[str] = Field(None, description="required API key(s), comma-separated")
    admin_key: Optional[str] = Field(None, description="key(s) for control-API writes "
                                     "(apply, delete, load, unload); unset: the API keys")
    allowed_hosts: Optional[str] = Field(
        None, description="more names the gateway answers to in the Host header, "
        "comma-separated (its bind address and loopback names always; * for any): other "
        "names are refused, which defeats DNS rebinding")
    allowed_origins: Optional[str] = Field(
        None, description="web origins whose pages may send inference requests (as "
        "OLLAMA_ORIGINS), comma-separated, * for any; apps and editors' webviews "
        "(app://, vscode-webview://, extensions) always may; control writes never")
    insecure: bool = Field(False, description="allow a non-loopback bind without an API key")
    node: Optional[str] = Field(None, description="fleets: this machine's name, a kind: Node "
                                "manifest in the folder (unset: a single machine)")
    fleet_key: Optional[str] = Field(None, description="fleets: the key nodes send each other; "
                                     "required when a node binds beyond loopback")
    fleet_dir: Optional[Path] = Field(None, description="fleets: the folder of the fleet's "
                                      "TLS material and key (`mlxfleet fleet init`/`join` "
                                      "write it); unset: STATE_DIR/fleet")
    fleet_plain_http: bool = Field(False, description="fleets: allow Node urls in plain "
                                   "http:// beyond loopback (prompts cross the network in "
                                   "clear); off: such a fleet refuses to start")
    node_bind: Optional[str] = Field(None, description="fleets: the address the TLS node "
                                     "listener binds (its port is the https url's); unset: "
                                     "the url's host when it is an IP address, else 0.0.0.0")
    fleet_grace: float = Field(15.0, gt=0, description="fleets: seconds a node may go "
                               "unanswered before its models move to other nodes")
    fleet_poll_interval: float = Field(2.0, gt=0, description="fleets: seconds between polls "
                                       "of the other nodes")
    peer_copy_rate_mb: int = Field(100, ge=0, description="fleets: MB/s at most a node "
                                   "takes from another when copying weights (so serving is "
                                   "not starved); 0 = no cap")
    pull_idle_timeout: float = Field(60.0, gt=0, description="seconds a download may go "
                                     "without a byte before it is stopped (pull again to "
                                     "continue it)")
    pull_timeout: float = Field(12 * 3600.0, gt=0, description="seconds a whole pull may "
                                "take")
    pull_free_margin_mb: int = Field(1024, ge=0, description="disk space a pull leaves free "
                                     "(a pull that would not is refused before it starts)")
    pull_concurrency: int = Field(2, ge=1, description="pulls running at once; more wait "
                                  "their turn (on their own threads: the control plane "
                                  "never waits behind a download)")
    peer_copy_without_hub: bool = Field(
        False, description="fleets: when the hub cannot be reached, copy weights from "
        "another node on its signed listing (the fleet key) instead of the hub's; off: a "
        "copy from a node is always checked against the hub's hashes")
    rate_limit: int = Field(0, ge=0, description="requests per minute per client; 0 = off")
    timeout: float = Field(300.0, gt=0, description="request timeout, seconds (per model: "
                           "spec.limits.timeout)")
    max_body_mb: int = Field(32, gt=0, description="largest request body")
    max_pending_body_mb: int = Field(256, gt=0, description="request bodies the gateway "
                                     "holds at once, all requests together; past it a new "
                                     "request is a 503 before its body is read")
    responses_store_max: int = Field(1000, ge=0, description="stored Responses API "
                                     "responses kept at most (oldest dropped first)")
    responses_store_mb: int = Field(64, ge=0, description="memory stored responses may use")
    responses_ttl: float = Field(3600.0, gt=0, description="seconds a stored response is "
                                 "kept")
    header_timeout: float = Field(30.0, gt=0, description="seconds a request's line and "
                                  "headers may take to arrive (408 and the connection "
                                  "closed after)")
    body_timeout: float = Field(60.0, gt=0, description="seconds a request body may take to "
                                "arrive (408 after)")
    allow_image_urls: bool = Field(False, description="let vision models fetch http(s) "
                                   "image URLs from requests (an SSRF risk: off by default)")
    max_image_mb: int = Field(20, gt=0, description="largest image in a request")
    max_image_pixels: int = Field(50_000_000, gt=0, description="largest image, in pixels")
    max_request_pixels: int = Field(64_000_000, gt=0, description="all the images of one "
                                    "request together, in pixels")
    max_images: int = Field(16, ge=1, description="images in one request")
    enable_metrics: bool = Field(False, description="serve Prometheus /metrics (no auth)")
    log_json: bool = Field(False, description="JSON log lines")
    # Per-model defaults for manifests that set none (unset: the worker's own defaults).
    max_tokens: Optional[int] = Field(None, ge=1, description="completion length when a "
                                      "request sets no max_tokens (spec.defaults.maxTokens)")
    max_request_tokens: Optional[int] = Field(None, ge=1, description="the largest max_tokens "
                                              "a request may ask for "
                                              "(spec.limits.maxRequestTokens)")
    max_prompt_tokens: Optional[int] = Field(None, ge=1, description="the longest prompt in "
                                             "tokens (spec.limits.maxPromptTokens)")
    default_temperature: Optional[float] = Field(None, ge=0, le=2)
    default_top_p: Optional[float] = Field(None, gt=0, le=1)
    stream_interval: Optional[int] = Field(None, ge=1)
    mcp_config: Optional[Path] = Field(None, description="MCP servers to start with the "
                                       "gateway (the mcpServers JSON of desktop assistants)")
    mcp: Optional[dict[str, Any]] = Field(None, description="MCP servers inline (the same "
                                          "JSON as an --mcp-config file), in the settings file")
    mcp_call_timeout: float = Field(60.0, gt=0, description="seconds an MCP tool call may take")
    mcp_max_result_kb: int = Field(1024, gt=0, description="larger MCP tool results are cut")
    speculative: Optional[Literal["auto", "off"]] = Field(
        None, description="speculative decoding for models whose manifest does not say "
        "(spec.speculative.mode; default auto)")
    use_paged_cache: Optional[bool] = Field(None, description="the block prefix cache for "
                                            "models whose manifest does not say "
                                            "(spec.cache.paged)")
    default_cache_percent: Optional[float] = Field(
        None, gt=0, le=1, description="KV budget of a model whose manifest sets none, as a "
        "share of physical memory (instead of default_cache_mb)")
    tool_call_parser: Optional[str] = Field(None, description="tool-call format of models "
                                            "whose manifest sets none (spec.parsers.toolCall)")
    reasoning_parser: Optional[str] = Field(None, description="reasoning parser of models "
                                            "whose manifest sets none (spec.parsers.reasoning)")
    enable_auto_tool_choice: Optional[bool] = Field(
        None, description="parse tool calls of models whose manifest names no tool-call "
        "parser (unset: yes; `serve SOURCE` follows vllm-mlx: only with the flag)")
    log_max_bytes: int = Field(10 << 20, gt=0)
    log_backups: int = Field(3, ge=0)

    config_file: Optional[Path] = Field(None, exclude=True)

    @field_validator("keep_alive")
    @classmethod
    def _keep_alive(cls, v: str) -> str:
        from .units import parse_duration

        parse_duration(v)
        return v

    @field_validator("memory_budget", "wired_limit")
    @classmethod
    def _budget(cls, v: Optional[str]) -> Optional[str]:
        from .units import parse_memory

        if v is not None and v != "auto":
            parse_memory(v, 1 << 30)
        return v

    @property
    def api_keys(self) -> list[str]:
        return comma_list(self.api_key)

    @property
    def origin_list(self) -> list[str]:
        return comma_list(self.allowed_origins)

    @property
    def host_names(self) -> list[str]:
        return comma_list(self.allowed_hosts)

    @property
    def admin_keys(self) -> list[str]:
        """Keys allowed to change the fleet: the admin keys, else the API keys."""
        return comma_list(self.admin_key) or self.api_keys

    @property
    def fleet_folder(self) -> Path:
        """Where the fleet's TLS material and key live (``fleet_tls``)."""
        return Path(self.fleet_dir).expanduser() if self.fleet_dir else self.state_dir / "fleet"

    @property
    def keep_alive_seconds(self) -> float:
        from .units import parse_duration

        return parse_duration(self.keep_alive)

    def memory_budget_bytes(self) -> tuple[int, str]:
        """The budget in bytes, and where it comes from (shown by ``get models``)."""
        import psutil

        from .accelerator import CUDA_SHARE, this_node
        from .units import parse_memory

        dev = this_node()  # the models' device: its memory, not the machine's, on CUDA
        total = int(dev.memory_bytes / CUDA_SHARE) if dev.kind == "cuda" and \
            dev.memory_bytes else psutil.virtual_memory().total
        if self.memory_budget != "auto":
            return parse_memory(self.memory_budget, total), f"set: {self.memory_budget}"
        if dev.memory_bytes:
            return dev.memory_bytes, dev.source
        return int(total * 0.7), "70% of physical memory"

    def wired_limit_bytes(self) -> Optional[int]:
        import psutil

        from .units import parse_memory

        if self.wired_limit is None:
            return None
        return parse_memory(self.wired_limit, psutil.virtual_memory().total)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings,
                                   dotenv_settings, file_secret_settings
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = os.environ.get("MLXFLEET_CONFIG")
        init = init_settings.init_kwargs if hasattr(init_settings, "init_kwargs") else {}
        path = init.get("config_file") or path
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if path:
            if not Path(path).is_file():
                raise FileNotFoundError(f"settings file {path} does not exist")
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


def comma_list(value: Optional[str]) -> list[str]:
    """A comma-separated setting (``a, b``) as its non-empty items."""
    return [x.strip() for x in (value or "").split(",") if x.strip()]


def load_settings(**flags: Any) -> ServerSettings:
    """Settings from flags (None values are treated as not given), env and file."""
    return ServerSettings(**{k: v for k, v in flags.items() if v is not None})
