"""The ``Model`` manifest: the one source of truth for spec fields.

A manifest file holds one or more YAML documents::

    apiVersion: mlxfleet/v1
    kind: Model
    metadata: {name: qwen3-8b, labels: {tier: chat}}
    spec: {source: mlx-community/Qwen3-8B-4bit, aliases: [default]}

Errors name the file, the document (1-based) and the field, as written in YAML.

Over 600 lines on purpose: the schema (``Manifest``, ``NodeManifest`` and their specs)
and the reader that turns files into them (YAML limits, per-field errors, names and
aliases unique across files) are one contract: the guide names this file the one
source of truth for spec fields, and an error is only as good as the schema path it
names. Its parts: the spec models, then errors and limits, then the file reader.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from . import names
from .units import parse_duration
from .worker_settings import default as _d

API_VERSION = "mlxfleet/v1"
MANIFEST_SUFFIXES = (".yaml", ".yml")
MAX_MANIFEST_BYTES = 1 << 20

#: Seconds; written back as the manifest would say it (``forever``: YAML's ``.inf`` is
#: not a duration, so a dumped ``keepAlive: forever`` must not become one).
Duration = Annotated[float, BeforeValidator(parse_duration), PlainSerializer(
    lambda v: "forever" if math.isinf(v) else v, when_used="json")]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True,
                              frozen=True)


class TextPart(_Spec):
    type: Literal["text"]
    text: str = Field(max_length=1 << 20)


class WarmMessage(_Spec):
    """One chat message of a warm prompt (OpenAI's shape, text only)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Annotated[str, Field(max_length=1 << 20)],
                   Annotated[list[TextPart], Field(max_length=64)]] = ""
    name: Optional[str] = Field(default=None, max_length=128)
    tool_call_id: Optional[str] = Field(default=None, max_length=128)


class CacheSpec(_Spec):
    """The worker's KV / prompt-cache memory budget."""

    memory_mb: Optional[int] = Field(default=None, gt=0, alias="memoryMB")
    memory_percent: Optional[float] = Field(default=None, gt=0, le=1,
                                            description="share of machine memory, 0-1")
    paged: Optional[bool] = Field(default=None, description="share prompt prefixes in "
                                  "64-token KV blocks (vllm-mlx's --use-paged-cache) instead "
                                  "of keeping whole prompts")
    disk_mb: Optional[int] = Field(default=None, ge=0, alias="diskMB", description="a disk "
                                   "tier for the prompt cache: evicted entries, and all of "
                                   "them when the model unloads, kept under the state dir "
                                   "and read back by the next worker of the same checkpoint")
    kv_bits: Optional[Literal[4, 8]] = Field(
        default=None, alias="kvBits", description="keep keys and values quantized to 4 or "
        "8 bits (mlx-lm's quantized KV cache): about 3.6x (4) or 1.9x (8) less KV memory "
        "per token, so more sequences and longer prompts fit the budget; models whose "
        "caches are not all plain key/value ones keep full precision (see paths.kv_cache)")
    volatile: Optional[Annotated[list[Annotated[str, Field(min_length=1, max_length=512)]],
                                 Field(max_length=32)]] = Field(
        default=None, description="regular expressions of text clients put in system "
        "prompts that changes every request and means nothing to the model (a billing "
        "hash, a timestamp): removed before the prompt is cached, besides the built-in "
        "ones (Claude Code's billing header)")
    scope: Optional[Literal["key", "shared"]] = Field(
        default=None, description="with API keys configured, whose cached prompts a "
        "request may reuse: key (default) only its own key's, so no key learns another's "
        "prompts from cache hits; shared: every key's (one team, one agent prefix)")
    warm_prompts: Union[
        Annotated[list[Annotated[list[WarmMessage], Field(min_length=1, max_length=256)]],
                  Field(max_length=64)],
        Annotated[str, Field(min_length=1, max_length=4096)], None] = Field(
        default=None, alias="warmPrompts", description="conversations (lists of chat "
        "messages), or a JSON file of them, prefilled into the prompt cache at load")

    @model_validator(mode="after")
    def _one_of(self):
        if self.memory_mb is not None and self.memory_percent is not None:
            raise ValueError("set memoryMB or memoryPercent, not both")
        for p in self.volatile or []:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"volatile pattern {p!r} is not a regular expression: "
                                 f"{e}") from None
        return self


class BatchingSpec(_Spec):
    """Continuous batching in the worker. Unset fields take the worker's defaults."""

    max_concurrency: Optional[int] = Field(
        default=None, ge=1, le=1024,
        description=f"sequences decoded together (default {_d('max_concurrency')})")
    max_queue: Optional[int] = Field(
        default=None, ge=0, description="requests beyond maxConcurrency that may wait (for "
        f"the model's load or for a batch slot) before 503 (default {_d('max_queue')})")
    prefill_batch_size: Optional[int] = Field(
        default=None, ge=1, description=f"prompts per prefill (default "
        f"{_d('prefill_batch_size')})")
    prefill_step_size: Optional[int] = Field(
        default=None, ge=16, description=f"prompt tokens per prefill chunk (default "
        f"{_d('prefill_step_size')})")
    warmup: Optional[bool] = Field(
        default=None, description="run a few short generations at load, before Ready, so "
        "that the first requests do not pay for kernels built on first use (default "
        f"{str(_d('warmup')).lower()})")


class SpeculativeSpec(_Spec):
    """Speculative decoding: several tokens per forward pass where the output repeats
    text already seen (prompt lookup), inside continuous batching."""

    mode: Optional[Literal["auto", "off"]] = Field(
        default=None, description="auto: draft when it pays (the acceptance rate against "
        "the measured cost of a wider step); off: one token per step (default "
        f"{_d('speculative')})")
    draft_tokens: Optional[int] = Field(
        default=None, ge=1, le=32, description="the most draft tokens a sequence sends in "
        f"one step (default {_d('draft_tokens')})")
    draft_model: Optional[str] = Field(
        default=None, min_length=1, description="a smaller model with the same tokenizer "
        "that drafts for every sequence (builtin:NAME, a directory or a Hugging Face repo "
        "id; pulled like the model, its weights count in the model's memory). Without "
        "one, drafts come from prompt lookup")


class LimitsSpec(_Spec):
    max_request_tokens: Optional[int] = Field(
        default=None, ge=1, description="the largest max_tokens a request may ask for (a "
        "larger one is lowered to it; server setting max_request_tokens, else the context)")
    max_prompt_tokens: Optional[int] = Field(
        default=None, ge=1, description="the longest prompt, in tokens (400 above; server "
        "setting max_prompt_tokens, else the context)")
    context_length: Optional[int] = Field(
        default=None, ge=16, description="the model's context in tokens, instead of what its "
        "config says (vLLM's --max-model-len, Ollama's num_ctx): lower it to bound memory, "
        "or raise it for a model whose positions go further")
    timeout: Optional[Duration] = None

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "maxTokens" in data:
            raise ValueError("limits.maxTokens was renamed limits.maxRequestTokens (the "
                             "largest max_tokens a request may ask for); the prompt-length "
                             "cap is limits.maxPromptTokens")
        return data


class DefaultsSpec(_Spec):
    """Sampling defaults when a request sets none (server settings, else the worker's)."""

    temperature: Optional[float] = Field(default=None, ge=0, le=2,
                                         description=f"default {_d('temperature')}")
    top_p: Optional[float] = Field(default=None, gt=0, le=1,
                                   description=f"default {_d('top_p')}")
    top_k: Optional[int] = Field(default=None, ge=0, description="default off (0)")
    max_tokens: Optional[int] = Field(
        default=None, ge=1, description="completion length when a request sets no max_tokens "
        "(default: the context left after the prompt, bounded by limits.maxRequestTokens)")
    stream_interval: Optional[int] = Field(
        default=None, ge=1, description="tokens per streamed chunk, at least; tokens that "
        "arrive together share one (default 1)")


class ParsersSpec(_Spec):
    tool_call: Optional[str] = Field(default=None, description="tool-call format; unset or "
                                     "auto: from the chat template")
    reasoning: Optional[str] = Field(default=None, description="qwen3 or deepseek_r1: split "
                                     "<think> reasoning from the answer")

    @model_validator(mode="after")
    def _known(self):
        from .formats import REASONING_PARSERS, TOOL_PARSERS

        if self.tool_call is not None and self.tool_call not in TOOL_PARSERS:
            raise ValueError(f"unknown toolCall parser {self.tool_call!r}; choose one of: "
                             + ", ".join(TOOL_PARSERS))
        if self.reasoning is not None and self.reasoning not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.reasoning!r}; choose one of: "
                             + ", ".join(REASONING_PARSERS))
        return self


class PlacementSpec(_Spec):
    """Which nodes of a fleet may run the model (neither field: any node)."""

    nodes: list[str] = Field(default_factory=list, description="the nodes allowed to run it")
    node_selector: dict[str, str] = Field(default_factory=dict, description="labels a node "
                                          "must carry (all of them) to run it")


class DistributedSpec(_Spec):
    """One model sharded over several nodes with MLX distributed (rank 0 serves)."""

    nodes: list[str] = Field(default_factory=list, description="the nodes that run its "
                             "ranks, rank 0 first")
    size: Optional[int] = Field(default=None, ge=2, le=16, description="how many nodes, "
                                "chosen by placement (instead of nodes)")
    backend: Literal["ring", "jaccl", "any"] = Field(
        default="ring", description="mlx.distributed backend: ring (TCP), jaccl (RDMA over "
        "Thunderbolt 5), any")
    strategy: Literal["tensor", "pipeline"] = Field(
        default="tensor", description="tensor parallel (the model's shard()) or pipeline "
        "parallel (layers split between ranks)")
    port: int = Field(default=43210, ge=1024, le=65535, description="first TCP port of the "
                      "ring (one per rank)")

    @model_validator(mode="after")
    def _one_of(self):
        if bool(self.nodes) == (self.size is not None):
            raise ValueError("set either nodes (a list of at least two nodes) or size")
        if self.nodes and (len(self.nodes) < 2 or len(set(self.nodes)) != len(self.nodes)):
            raise ValueError("nodes must name at least two different nodes")
        return self


class ReplicasSpec(_Spec):
    """Copies of the model on distinct nodes of a fleet, scaled by load between ``min``
    and ``max`` (``min: 0``: none while idle, one loaded on demand)."""

    min: int = Field(default=1, ge=0, le=64, description="replicas kept at least (0: "
                     "scale to zero when idle)")
    max: int = Field(default=1, ge=1, le=64, description="replicas at most")
    target_wait: Optional[Duration] = Field(
        default=None, description="add a replica while requests wait longer than this for "
        "their first token on a copy (the median of the last minute); default 2s")

    @model_validator(mode="after")
    def _order(self):
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) must be at least min ({self.min})")
        return self


class ModelSpec(_Spec):
    source: str = Field(min_length=1, description="HF repo id, local path, or builtin:NAME")
    task: Literal["generate", "embedding", "vision"] = Field(
        default="generate", description="embedding: serve /v1/embeddings (BERT-family); "
        "vision: a vision-language model through mlx-vlm (found from the checkpoint's "
        "config when left at generate)")
    revision: Optional[str] = None
    aliases: list[str] = Field(default_factory=list)
    keep_alive: Optional[Duration] = None
    preload: bool = Field(default=False, description="load at start and on apply; "
                          "otherwise on the first request")
    client_keep_alive: bool = Field(
        default=False, description="with API keys configured, let client keys shorten the "
        "keep-alive or unload the model with a request's keep_alive (otherwise only admin "
        "keys may; client keys can only extend it)")
    pinned: bool = Field(default=False, description="never evicted to make room")
    priority: int = Field(default=0, description="higher stays loaded longer under "
                          "memory pressure")
    cache: CacheSpec = Field(default_factory=CacheSpec)
    batching: BatchingSpec = Field(default_factory=BatchingSpec)
    speculative: SpeculativeSpec = Field(default_factory=SpeculativeSpec)
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    defaults: DefaultsSpec = Field(default_factory=DefaultsSpec)
    parsers: ParsersSpec = Field(default_factory=ParsersSpec)
    env: dict[str, str] = Field(default_factory=dict)
    trust_remote_code: bool = False
    placement: PlacementSpec = Field(default_factory=PlacementSpec, description="fleets: "
                                     "the nodes that may run the model")
    distributed: Optional[DistributedSpec] = Field(default=None, description="fleets: run "
                                                   "the model sharded over several nodes")
    replicas: Union[int, ReplicasSpec] = Field(
        default=1, description="fleets: copies of the model on distinct nodes, each serving "
        "alone; requests go to the copy holding their conversation's prefix. A number, or "
        "{min, max} to scale by load")

    @model_validator(mode="after")
    def _sharded(self):
        if self.distributed is not None and self.task != "generate":
            raise ValueError("only text generation models can be sharded (spec.distributed "
                             f"with task {self.task})")
        if self.distributed is not None and self.replica_range != (1, 1):
            raise ValueError("a sharded model (spec.distributed) has one copy: replicas "
                             "must be 1")
        return self

    @field_validator("replicas")
    @classmethod
    def _replicas(cls, v):
        if isinstance(v, int) and not 1 <= v <= 64:
            raise ValueError("replicas is a number from 1 to 64, or {min, max}")
        return v

    @property
    def replica_range(self) -> tuple[int, int]:
        """(fewest, most) replicas: (n, n) for a number."""
        r = self.replicas
        return (r, r) if isinstance(r, int) else (r.min, r.max)

    @field_validator("aliases")
    @classmethod
    def _aliases(cls, v: list[str]) -> list[str]:
        for a in v:
            names.alias(a)
        if len(set(v)) != len(v):
            raise ValueError("aliases must not repeat")
        return v


class Metadata(_Spec):
    name: str
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return names.model_name(v)


class _Document(_Spec):
    """What every document has: ``apiVersion``, ``kind`` (in subclasses), ``metadata``."""

    api_version: Literal["mlxfleet/v1"] = Field(alias="apiVersion")
    metadata: Metadata

    @property
    def name(self) -> str:
        return self.metadata.name


class Manifest(_Document):
    """One ``kind: Model`` document."""

    kind: Literal["Model"]
    spec: ModelSpec

    def source_changed(self, other: Manifest) -> bool:
        return (self.spec.source, self.spec.revision) != (other.spec.source,
                                                          other.spec.revision)

    @functools.cached_property
    def _hash(self) -> str:
        s = self.spec.model_dump(exclude={"aliases", "keep_alive", "preload", "pinned",
                                          "priority", "placement", "client_keep_alive",
                                          "replicas"})
        return hashlib.sha256(json.dumps(s, sort_keys=True, default=str).encode()).hexdigest()[:12]

    def worker_hash(self) -> str:
        """Hash of the fields a running worker depends on: a change means a new worker.

        Aliases, labels, keepAlive, clientKeepAlive, preload, pinned, placement and replicas
        are the gateway's and the scheduler's business and change without a restart (a
        new placement moves the model, which is a stop here and a start there). Computed once
        (where the file is parsed, off the event loop).
        """
        return self._hash


class NodeSpec(_Spec):
    url: str = Field(min_length=1, description="where the other nodes reach this one, e.g. "
                     "https://studio.local:8443 (mutual TLS: `mlxfleet fleet init`)")
    memory: Optional[str] = Field(default=None, description="the most memory mlxfleet may "
                                  "use there (12GB, 70%); unset: the node's own budget")
    address: Optional[str] = Field(default=None, description="the host other nodes reach "
                                   "for MLX distributed rings (default: the url's host)")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        from urllib.parse import urlsplit

        u = urlsplit(v)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"{v!r} must be an http(s) URL with a host, e.g. "
                             "https://studio.local:8443")
        return v.rstrip("/")

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: Optional[str]) -> Optional[str]:
        from .units import parse_memory

        if v is not None:
            parse_memory(v, 1 << 30)
        return v

    def memory_bytes(self, total: int) -> Optional[int]:
        from .units import parse_memory

        return parse_memory(self.memory, total) if self.memory is not None else None

    @property
    def host(self) -> str:
        from urllib.parse import urlsplit

        return self.address or urlsplit(self.url).hostname


class NodeManifest(_Document):
    """One ``kind: Node`` document: a machine of the fleet."""

    kind: Literal["Node"]
    spec: NodeSpec


@dataclass
class ManifestError:
    """A problem in one file, located as precisely as we can."""

    file: str
    message: str
    document: Optional[int] = None
    field: Optional[str] = None

    def __str__(self) -> str:
        where = self.file
        if self.document is not None:
            where += f" (document {self.document})"
        if self.field:
            where += f": {self.field}"
        return f"{where}: {self.message}"


@dataclass
class LoadedManifest:
    manifest: Manifest
    file: str
    document: int


@dataclass
class FileResult:
    """One file's models and nodes, or the errors that kept it from loading."""

    file: str
    models: list[LoadedManifest] = field(default_factory=list)
    errors: list[ManifestError] = field(default_factory=list)
    nodes: list[NodeManifest] = field(default_factory=list)


def _union_member(part: str) -> bool:
    """pydantic names the member of a union it tried (``list[WarmMessage]``,
    ``constrained-str``) in an error's location: not a field the user wrote."""
    return ("[" in part or part.startswith(("function-", "constrained-"))
            or part in ("str", "int", "float", "bool", "list", "dict"))


def _field_path(loc: tuple) -> str:
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and not _union_member(p):
            out += ("." if out else "") + p
    return out


def _validation_errors(file: str, doc: int, err: ValidationError) -> list[ManifestError]:
    out: list[ManifestError] = []
    for e in err.errors():
        path = _field_path(e["loc"])
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        me = ManifestError(file, msg, doc, path or None)
        if me not in out:
            out.append(me)
    return out


#: The most YAML nodes one file may stand for once its aliases are expanded: a manifest
#: is a few hundred; a "billion laughs" (anchors of anchors) is billions, and expanding it
#: would take the server's memory and minutes of CPU.
MAX_EXPANDED_NODES = 100_000


class ManifestTooLarge(ValueError):
    pass


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many nodes ``node`` stands for with every alias expanded. Aliases share the
    node they name, so each node is measured once (memoized by identity): the walk is
    linear in the file however much it would expand."""
    done = sizes.get(id(node))
    if done is not None:
        return done
    sizes[id(node)] = MAX_EXPANDED_NODES + 1  # a node that contains itself: never finite
    n = 1
    if isinstance(node, yaml.SequenceNode):
        n += sum(_expanded_size(c, sizes) for c in node.value)
    elif isinstance(node, yaml.MappingNode):
        n += sum(_expanded_size(k, sizes) + _expanded_size(v, sizes) for k, v in node.value)
    n = min(n, MAX_EXPANDED_NODES + 1)
    sizes[id(node)] = n
    return n


def safe_load_documents(text: str) -> list[Any]:
    """``yaml.safe_load_all`` with a budget: the node graph is composed first (linear in
    the text) and refused before construction if it would expand past
    ``MAX_EXPANDED_NODES`` (counting every alias as the nodes it repeats)."""
    loader = yaml.SafeLoader(text)
    docs, total = [], 0
    try:
        while loader.check_node():
            node = loader.get_node()
            total += _expanded_size(node, {})
            if total > MAX_EXPANDED_NODES:
                raise ManifestTooLarge(
                    f"the file expands to more than {MAX_EXPANDED_NODES} YAML nodes once "
                    "its anchors and aliases are expanded; manifests are small")
            docs.append(loader.construct_document(node))
    finally:
        loader.dispose()
    return docs


@dataclass(frozen=True)
class Rules:
    """What the server accepts beyond the schema: the folder reader, ``apply`` and
    ``validate`` all parse through ``parse_text`` with these, so they agree."""

    #: larger manifest files are refused unread (a typo'd path to a big file, or a hostile
    #: one, must not stall the watcher)
    max_bytes: int = MAX_MANIFEST_BYTES
    #: spec.env names allowed although they change how a worker loads code
    allow_env: tuple[str, ...] = ()

    def too_big(self, file: str, size: int) -> Optional[ManifestError]:
        if size <= self.max_bytes:
            return None
        return ManifestError(file, f"the file is {size} bytes; manifests may be at most "
                             f"{self.max_bytes} bytes (setting max_manifest_bytes)")


#: spec.env names that change what code a worker loads: refused unless the server allows them.
LOADER_ENV = ("LD_*", "DYLD_*", "PYTHON*", "PATH")


def env_matches(name: str, patterns) -> bool:
    """Whether ``name`` is one of ``patterns`` (exact, or a prefix ending in ``*``)."""
    return any(name == p or (p.endswith("*") and name.startswith(p[:-1])) for p in patterns)


def _refuse_loader_env(r: FileResult, allowed: tuple[str, ...]) -> None:
    """Make a file's models an error when their spec.env would change how code is loaded
    (``PYTHONPATH`` + a sitecustomize, ``LD_PRELOAD``: code run as the server's user)."""
    for lm in r.models:
        for name in lm.manifest.spec.env:
            if env_matches(name.upper(), LOADER_ENV) and not env_matches(name, allowed):
                r.errors.append(ManifestError(
                    r.file, f"{name} changes how the worker loads code and is refused; the "
                    "server's allow_worker_env setting can allow it", lm.document,
                    f"spec.env.{name}"))


def parse_text(text: str, file: str, rules: Rules = Rules()) -> FileResult:
    """Parse and check one file's text (any number of ``---`` documents)."""
    res = FileResult(file)
    big = rules.too_big(file, len(text.encode("utf-8", errors="replace")))
    if big is not None:
        res.errors.append(big)
        return res
    try:
        docs = safe_load_documents(text)
    except ManifestTooLarge as e:
        res.errors.append(ManifestError(file, str(e)))
        return res
    except RecursionError:
        res.errors.append(ManifestError(file, "invalid YAML: nested too deeply"))
        return res
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        res.errors.append(ManifestError(file, f"invalid YAML{where}: {problem}"))
        return res
    for i, doc in enumerate(docs, start=1):
        if doc is None:
            continue  # empty document (e.g. a trailing ---)
        if not isinstance(doc, dict):
            res.errors.append(ManifestError(file, "a document must be a mapping", i))
            continue
        try:
            if doc.get("kind") == "Node":
                res.nodes.append(NodeManifest.model_validate(doc))
            else:
                res.models.append(LoadedManifest(Manifest.model_validate(doc), file, i))
        except ValidationError as e:
            res.errors.extend(_validation_errors(file, i, e))
    _refuse_loader_env(res, rules.allow_env)
    for lm in res.models:
        lm.manifest.worker_hash()  # computed here, off the event loop, and kept
    return res


def is_manifest_file(path: Path) -> bool:
    """YAML files, skipping hidden files and editors' temporaries."""
    n = path.name
    return (path.suffix in MANIFEST_SUFFIXES and not n.startswith((".", "#", "~"))
            and path.is_file())


def manifest_files(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            out.extend(sorted(f for f in p.iterdir() if is_manifest_file(f)))
        else:
            out.append(p)
    return out


def parse_file(path: Path, rules: Rules = Rules()) -> FileResult:
    try:
        big = rules.too_big(str(path), path.stat().st_size)
        if big is not None:
            return FileResult(str(path), errors=[big])
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return FileResult(str(path), errors=[ManifestError(str(path), f"cannot read: {e}")])
    return parse_text(text, str(path), rules)


def check_unique(results: list[FileResult], owners: frozenset[str] = frozenset()) -> None:
    """Names and aliases must be unique across files. The files in ``owners`` (those whose
    models already run) keep what they hold; otherwise the earlier file in name order wins.
    A clash is an error of the newcomer, whatever the file names."""
    owner: dict[str, str] = {}  # name or alias -> "file (document N)"
    nodes: dict[str, str] = {}  # node name -> file
    for res in sorted(results, key=lambda r: r.file not in owners):
        if res.errors:
            continue
        for node in res.nodes:
            if node.name in nodes:
                res.errors.append(ManifestError(res.file, f"node {node.name!r} is already "
                                                f"defined by {nodes[node.name]}",
                                                field="metadata.name"))
            nodes[node.name] = res.file
        for lm in res.models:
            here = f"{lm.file} (document {lm.document})"
            keys = [("metadata.name", lm.manifest.name)] + [
                (f"spec.aliases[{i}]", a) for i, a in enumerate(lm.manifest.spec.aliases)]
            for fld, key in keys:
                if key in owner:
                    res.errors.append(ManifestError(
                        lm.file, f"{key!r} is already used by {owner[key]}", lm.document, fld))
                elif is_pattern(key):
                    for other, where in owner.items():
                        if is_pattern(other) and patterns_overlap(key, other):
                            res.errors.append(ManifestError(
                                lm.file, f"alias pattern {key!r} overlaps {other!r} of "
                                f"{where}: one name would match both", lm.document, fld))
                            break
            if not res.errors:
                for _, key in keys:
                    owner[key] = here


def is_pattern(alias: str) -> bool:
    """Aliases with ``*``, ``?`` or ``[...]`` are glob patterns (``claude-*``)."""
    return any(c in alias for c in "*?[")


def patterns_overlap(a: str, b: str) -> bool:
    """Whether some name could match both patterns: checked on the names each pattern
    writes literally (``claude-*`` and ``claude-3*`` overlap; ``gpt-*`` and ``claude-*``
    do not). Two patterns with no literal part in common in that sense pass."""
    from fnmatch import fnmatchcase

    def sample(p: str) -> str:  # one name the pattern matches
        return p.replace("*", "").replace("?", "x").split("[", 1)[0]

    return fnmatchcase(sample(a), b) or fnmatchcase(sample(b), a)


def load_paths(paths: list[Path], owners: frozenset[str] = frozenset(),
               rules: Rules = Rules()) -> list[FileResult]:
    """Parse every manifest file under ``paths`` and check cross-file uniqueness
    (``owners``: files whose names are taken first, see ``check_unique``)."""
    results = [parse_file(p, rules) for p in manifest_files(paths)]
    check_unique(results, owners)
    return results


def json_schema() -> dict[str, Any]:
    """JSON Schema for editors (``# yaml-language-server: $schema=...``)."""
    schema = Manifest.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "mlxfleet Model manifest"
    return schema


def dump_manifest(m: Manifest) -> str:
    return yaml.safe_dump(m.model_dump(by_alias=True, exclude_defaults=True, mode="json"),
                          sort_keys=False)


