"""The manifest schema, the pure reconcile decisions, `validate` and `schema`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from mlxfleet.manifest import load_paths, parse_text
from mlxfleet.supervisor.apply import apply_text, delete_model
from mlxfleet.supervisor.lifecycle import backoff_delay, failures_after_exit
from mlxfleet.supervisor.reconcile import Action, plan
from mlxfleet.units import parse_duration

ROOT = Path(__file__).resolve().parent.parent

FULL = """\
apiVersion: mlxfleet/v1
kind: Model
metadata:
  name: qwen3-8b
  labels: {tier: chat}
spec:
  source: mlx-community/Qwen3-8B-4bit
  revision: main
  aliases: [default, gpt-4o-mini]
  keepAlive: 10m
  preload: true
  cache: {memoryMB: 2048}
  batching: {maxConcurrency: 16, maxQueue: 64}
  limits: {maxRequestTokens: 4096, maxPromptTokens: 32768, timeout: 300s}
  defaults: {temperature: 0.7, topP: 0.9}
  parsers: {toolCall: hermes, reasoning: qwen3}
  env: {}
"""


def doc(name="m", **spec):
    body = "".join(f"\n  {k}: {json.dumps(v)}" for k, v in spec.items())
    return f"apiVersion: mlxfleet/v1\nkind: Model\nmetadata: {{name: {name}}}\nspec:" \
           f"\n  source: builtin:tiny{body}\n"


def test_the_documented_example_parses():
    r = parse_text(FULL, "f.yaml")
    assert not r.errors
    m = r.models[0].manifest
    assert m.name == "qwen3-8b" and m.spec.aliases == ["default", "gpt-4o-mini"]
    assert m.spec.keep_alive == 600 and m.spec.cache.memory_mb == 2048
    assert m.spec.limits.timeout == 300 and m.spec.defaults.top_p == 0.9
    assert m.spec.parsers.tool_call == "hermes"


@pytest.mark.parametrize("text,field,words", [
    (doc(bogus=1), "spec.bogus", "unknown field"),
    (doc(batching={"maxConcurrency": "x"}), "spec.batching.maxConcurrency", "integer"),
    (doc(keepAlive="soon"), "spec.keepAlive", "not a duration"),
    (doc(cache={"memoryMB": 1, "memoryPercent": 0.1}), "spec.cache", "not both"),
    (doc(name="Bad_Name"), "metadata.name", "DNS label"),
    (doc(aliases=["a", "a"]), "spec.aliases", "repeat"),
    ("apiVersion: mlxfleet/v2\nkind: Model\nmetadata: {name: x}\nspec: {source: y}\n",
     "apiVersion", "mlxfleet/v1"),
    ("apiVersion: mlxfleet/v1\nkind: Model\nmetadata: {name: x}\n", "spec", "missing"),
])
def test_errors_name_file_document_and_field(text, field, words):
    r = parse_text(doc("ok") + "---\n" + text, "dir/f.yaml")
    assert len(r.models) == 1 and r.errors
    e = r.errors[0]
    assert e.file == "dir/f.yaml" and e.document == 2 and e.field == field
    assert words in str(e)


def test_invalid_yaml_names_the_line():
    r = parse_text("apiVersion: [\n", "x.yaml")
    assert "invalid YAML at line" in str(r.errors[0])


def test_duplicate_names_and_aliases_across_files(tmp_path):
    (tmp_path / "a.yaml").write_text(doc("one", aliases=["chat"]))
    (tmp_path / "b.yaml").write_text(doc("two", aliases=["chat"]))
    (tmp_path / "c.yaml").write_text(doc("one"))
    (tmp_path / ".hidden.yaml").write_text("not: [valid")
    (tmp_path / "notes.txt").write_text("ignored")
    results = {Path(r.file).name: r for r in load_paths([tmp_path])}
    assert set(results) == {"a.yaml", "b.yaml", "c.yaml"}
    assert not results["a.yaml"].errors
    assert "'chat' is already used by" in str(results["b.yaml"].errors[0])
    assert results["b.yaml"].errors[0].field == "spec.aliases[0]"
    assert "'one' is already used" in str(results["c.yaml"].errors[0])


@pytest.mark.parametrize("value,seconds", [
    ("30s", 30), ("5m", 300), ("1h30m", 5400), (0, 0), ("0", 0), (90, 90), ("250ms", 0.25),
    (-1, math.inf), ("forever", math.inf), ("-1", math.inf)])
def test_durations(value, seconds):
    assert parse_duration(value) == seconds


def test_worker_hash_ignores_gateway_only_fields():
    a = parse_text(doc("m"), "f").models[0].manifest
    b = parse_text(doc("m", aliases=["x"], keepAlive="1h", preload=False), "f").models[0]
    c = parse_text(doc("m", defaults={"temperature": 0.1}), "f").models[0].manifest
    assert a.worker_hash() == b.manifest.worker_hash()
    assert a.worker_hash() != c.worker_hash()


def test_plan_is_create_keep_replace_delete():
    got = plan({"new": "h1", "same": "h2", "changed": "h3"},
               {"same": "h2", "changed": "old", "gone": "h4"})
    assert got == {"new": Action.CREATE, "same": Action.KEEP, "changed": Action.REPLACE,
                   "gone": Action.DELETE}
    assert plan({}, {}) == {}


def test_backoff_doubles_to_a_cap_and_resets_after_a_stable_period():
    assert [backoff_delay(n, 1, 60) for n in range(0, 9)] == [0, 1, 2, 4, 8, 16, 32, 60, 60]
    assert backoff_delay(10_000, 1, 300) == 300
    assert failures_after_exit(5, ready_seconds=3, stable_period=60) == 6
    assert failures_after_exit(5, ready_seconds=61, stable_period=60) == 1


def test_apply_and_delete_edit_files_in_place(tmp_path):
    multi = tmp_path / "many.yaml"
    multi.write_text("# header comment\n" + doc("a") + "---\n# about b\n" + doc("b"))
    out = apply_text(tmp_path, doc("b", aliases=["bee"]))
    assert [(a.name, a.action) for a in out] == [("b", "configured")]
    text = multi.read_text()
    assert text.startswith("# header comment") and "# about b" in text and "bee" in text
    assert [lm.manifest.name for r in load_paths([tmp_path]) for lm in r.models] == ["a", "b"]
    assert delete_model(tmp_path, "a") == str(multi)
    names = [lm.manifest.name for r in load_paths([tmp_path]) for lm in r.models]
    assert names == ["b"] and not any(r.errors for r in load_paths([tmp_path]))
    assert delete_model(tmp_path, "b") == str(multi)
    assert not multi.exists()
    assert delete_model(tmp_path, "zzz") is None


def test_apply_never_overwrites_another_models_file_and_respects_links_and_modes(tmp_path):
    import os
    import stat

    other = tmp_path / "foo.yaml"
    other.write_text("# keep me\n" + doc("bar"))
    out = apply_text(tmp_path, doc("foo"))
    assert out[0].action == "created" and out[0].file.endswith("foo-2.yaml")
    assert other.read_text().startswith("# keep me") and "bar" in other.read_text()
    names = sorted(lm.manifest.name for r in load_paths([tmp_path]) for lm in r.models)
    assert names == ["bar", "foo"]
    # A symlinked manifest is edited through the link, and keeps its mode.
    real = tmp_path / "real"
    real.mkdir()
    (real / "m.yaml").write_text(doc("linked"))
    os.chmod(real / "m.yaml", 0o640)
    (tmp_path / "linked.yaml").symlink_to(real / "m.yaml")
    apply_text(tmp_path, doc("linked", aliases=["l"]))
    assert (tmp_path / "linked.yaml").is_symlink() and "l" in (real / "m.yaml").read_text()
    assert stat.S_IMODE(os.stat(real / "m.yaml").st_mode) == 0o640


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mlxfleet", *args], capture_output=True,
                          text=True, timeout=60)


def test_validate_command(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(FULL)
    r = _cli("validate", str(good))
    assert r.returncode == 0 and "ok:" in r.stdout and "qwen3-8b" in r.stdout
    r = _cli("validate", str(ROOT / "manifests"))
    assert r.returncode == 0 and "tiny" in r.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(doc("x", batching={"maxQueue": -1}))
    r = _cli("validate", str(good), str(bad))
    assert r.returncode == 1
    assert "bad.yaml (document 1): spec.batching.maxQueue" in r.stderr
    r = _cli("validate", str(tmp_path / "missing.yaml"))
    assert r.returncode == 1 and "no such file" in r.stderr


def test_schema_command_matches_the_committed_schema():
    r = _cli("schema")
    schema = json.loads(r.stdout)
    assert schema["properties"]["apiVersion"]["const"] == "mlxfleet/v1"
    assert "keepAlive" in json.dumps(schema) and "memoryMB" in json.dumps(schema)
    # docs/manifest.schema.json is what editors load; it must not drift.
    assert json.loads((ROOT / "docs" / "manifest.schema.json").read_text()) == schema


@pytest.mark.parametrize("folder", ["manifests", "examples", "examples/fleet",
                                    "examples/pull-and-serve"])
def test_bundled_manifests_and_examples_validate(folder):
    results = load_paths([ROOT / folder])
    assert results and not [str(e) for r in results for e in r.errors]


NODE = "apiVersion: mlxfleet/v1\nkind: Node\nmetadata: {name: %s}\nspec: {url: '%s'}\n"
SHARDED = ("apiVersion: mlxfleet/v1\nkind: Model\nmetadata: {name: big}\n"
           "spec: {source: builtin:tiny, %s}\n")


@pytest.mark.parametrize("text,where,words", [
    (NODE % ("studio", "studio.local:8000"), "spec.url", "must be an http(s) URL"),
    (NODE % ("Studio", "http://studio.local:8000"), "metadata.name", "lowercase DNS label"),
    (SHARDED % "distributed: {nodes: [a]}", "spec.distributed", "at least two"),
    (SHARDED % "distributed: {nodes: [a, b], size: 2}", "spec.distributed", "either nodes"),
    (SHARDED % "task: embedding, distributed: {size: 2}", "spec", "text generation"),
    (SHARDED % "placement: {nodez: [a]}", "spec.placement.nodez", "unknown field"),
])
def test_fleet_documents_are_checked(text, where, words):
    errors = parse_text(text, "f.yaml").errors
    assert errors and errors[0].field == where and words in errors[0].message, errors


def test_nodes_parse_beside_models_and_a_node_name_is_unique():
    a = parse_text(NODE % ("studio", "http://studio.local:8000/") + "---\n"
                   + SHARDED % "placement: {nodeSelector: {tier: big}}", "a.yaml")
    assert not a.errors and [n.name for n in a.nodes] == ["studio"]
    assert a.nodes[0].spec.url == "http://studio.local:8000" and a.nodes[0].spec.host == \
        "studio.local"
    assert a.models[0].manifest.spec.placement.node_selector == {"tier": "big"}
    b = parse_text(NODE % ("studio", "http://other:8000"), "b.yaml")
    from mlxfleet.manifest import check_unique

    check_unique([a, b])
    assert "already defined by a.yaml" in str(b.errors[0])


def test_settings_flags_override_env_override_file(tmp_path, monkeypatch):
    from mlxfleet.settings import load_settings

    cfg = tmp_path / "settings.yaml"
    cfg.write_text("port: 9000\nhost: 127.0.0.2\ndrain_timeout: 5\n")
    monkeypatch.setenv("MLXFLEET_CONFIG", str(cfg))
    monkeypatch.setenv("MLXFLEET_PORT", "9100")
    s = load_settings()
    assert (s.port, s.host, s.drain_timeout) == (9100, "127.0.0.2", 5)
    assert load_settings(port=9200, host=None).port == 9200
    monkeypatch.setenv("MLXFLEET_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(FileNotFoundError):
        load_settings()


def test_worker_config_takes_spec_then_server_defaults_then_its_own():
    from mlxfleet.manifest import Manifest
    from mlxfleet.settings import ServerSettings
    from mlxfleet.supervisor.worker_config import worker_config
    from mlxfleet.worker_settings import WorkerConfig

    server = ServerSettings(default_cache_mb=256, max_request_tokens=300, max_tokens=40,
                            default_temperature=0.2)
    bare = Manifest.model_validate({"apiVersion": "mlxfleet/v1", "kind": "Model",
                                    "metadata": {"name": "m"}, "spec": {"source": "x/y"}})
    c = worker_config(bare, server)
    assert c.cache_bytes == 256 << 20  # the server's default budget reaches the worker
    assert (c.max_request_tokens, c.max_tokens, c.temperature) == (300, 40, 0.2)
    assert c.max_queue == WorkerConfig.model_fields["max_queue"].default  # one default
    own = bare.model_copy(update={"spec": bare.spec.model_copy(update={
        "cache": bare.spec.cache.model_copy(update={"memory_mb": 64}),
        "limits": bare.spec.limits.model_copy(update={"max_request_tokens": 99})})})
    c = worker_config(own, server)
    assert c.cache_bytes == 64 << 20 and c.max_request_tokens == 99
    # The worker's own command line builds the same object.
    r = _cli("worker", "--source", "builtin:tiny", "--max-queue", "-1")
    assert r.returncode == 2 and "max_queue" in r.stderr


def test_every_worker_setting_reaches_the_worker_from_manifest_server_and_flag():
    """The table in worker_settings is the only mapping: each row's manifest field, server
    setting and flag really carry a value to the worker (a typo would drop it)."""
    import argparse

    from mlxfleet.cli import _add_worker, worker_config_from_args
    from mlxfleet.manifest import Manifest
    from mlxfleet.settings import ServerSettings
    from mlxfleet.supervisor.worker_config import worker_config
    from mlxfleet.worker_settings import SETTINGS

    samples = {int: 32, float: 0.5, str: "hermes", bool: True}
    bare = {"apiVersion": "mlxfleet/v1", "kind": "Model", "metadata": {"name": "m"},
            "spec": {"source": "x/y"}}
    parser = argparse.ArgumentParser()
    _add_worker(parser.add_subparsers(dest="command"))
    for row in SETTINGS:
        value = row.type[-1] if isinstance(row.type, tuple) else samples.get(row.type)
        if row.field == "reasoning_parser":
            value = "qwen3"
        if row.field == "revision":
            value = "main"
        if row.field == "volatile":
            value = ["^Time: .*$"]
        if row.manifest:
            doc = json.loads(json.dumps(bare))
            *parents, leaf = row.manifest.split(".")
            node = doc["spec"]
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
            m = Manifest.model_validate(doc)
            assert getattr(worker_config(m, ServerSettings()), row.field) == value, row
        if row.server:
            m = Manifest.model_validate(bare)
            got = worker_config(m, ServerSettings(**{row.server: value}))
            assert getattr(got, row.field) == value, row
        if row.flag:
            argv = ["worker", "--source", "x/y", row.flag] + ([] if row.type is bool
                                                              else [str(value)])
            cfg = worker_config_from_args(parser.parse_args(argv))
            assert getattr(cfg, row.field) == value, row


def test_renamed_limit_says_where_it_went():
    r = parse_text(doc(limits={"maxTokens": 4096}), "m.yaml")
    assert r.errors and "limits.maxRequestTokens" in str(r.errors[0])


def test_unknown_parser_is_a_manifest_error():
    r = parse_text(doc(parsers={"toolCall": "nope"}), "m.yaml")
    assert r.errors and "unknown toolCall parser 'nope'" in str(r.errors[0])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e300, "99999999999d", "nan"])
def test_absurd_durations_are_errors(value):
    with pytest.raises(ValueError):
        parse_duration(value)


def test_oversized_and_deeply_nested_files_are_errors_not_crashes(tmp_path):
    from mlxfleet.manifest import MAX_MANIFEST_BYTES

    (tmp_path / "big.yaml").write_text("# " + "x" * MAX_MANIFEST_BYTES + "\n")
    (tmp_path / "deep.yaml").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    (tmp_path / "ok.yaml").write_text(doc("ok"))
    results = {Path(r.file).name: r for r in load_paths([tmp_path])}
    assert "at most" in str(results["big.yaml"].errors[0])
    assert "nested too deeply" in str(results["deep.yaml"].errors[0])
    assert [lm.manifest.name for lm in results["ok.yaml"].models] == ["ok"]


# ---- apply and delete on multi-document files: every other document byte for byte ----

def _docs_text(text: str) -> list[str]:
    """Each document's own text (from its first key to its last value)."""
    import yaml

    from mlxfleet.supervisor.apply import _content_end

    return [text[n.start_mark.index:_content_end(n)].rstrip()
            for n in yaml.compose_all(text) if n is not None]


def _model_doc(name: str, block: bool, labels: bool, trailing: str) -> str:
    if block:
        return (f"apiVersion: mlxfleet/v1\nkind: Model\nmetadata:\n  name: {name}\n"
                + ("  labels:\n    tier: chat\n" if labels else "")
                + f"spec:\n  source: builtin:tiny{trailing}\n")
    return (f"{{apiVersion: mlxfleet/v1, kind: Model, metadata: {{name: {name}"
            + (", labels: {tier: chat}" if labels else "")
            + f"}}, spec: {{source: 'builtin:tiny'}}}}{trailing}\n")


def _multi_file(draw_docs: list[tuple[bool, bool, str, str, str]]) -> tuple[str, list[str]]:
    names = [f"m{i}" for i in range(len(draw_docs))]
    parts = []
    for i, (block, labels, head, trailing, sep) in enumerate(draw_docs):
        if i:
            parts.append(sep)
        parts.append(head + _model_doc(names[i], block, labels, trailing))
    return "".join(parts), names


def test_applying_or_deleting_one_document_leaves_every_other_byte_identical(tmp_path):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    shape = st.tuples(st.booleans(), st.booleans(),
                      st.sampled_from(["", "# about it\n", "\n# two\n# lines\n"]),
                      st.sampled_from(["", "  # why", "\n# trailing comment", "\n\n"]),
                      st.sampled_from(["---\n", "--- # next\n", "\n---\n", "---\n\n"]))

    @settings(max_examples=150, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(shape, min_size=1, max_size=4), st.data())
    def check(shapes, data):
        text, names = _multi_file(shapes)
        k = data.draw(st.integers(0, len(names) - 1))
        block = data.draw(st.booleans())
        for old in tmp_path.iterdir():
            old.unlink()
        f = tmp_path / "many.yaml"
        f.write_text(text)
        before = _docs_text(text)
        # apply document k with a changed label: only its text changes
        out = apply_text(tmp_path, _model_doc(names[k], block, True, "").replace(
            "chat", "batch"))
        assert [(a.name, a.action) for a in out] == [(names[k], "configured")]
        after_text = f.read_text()
        after = _docs_text(after_text)
        assert [d for i, d in enumerate(after) if i != k] == \
            [d for i, d in enumerate(before) if i != k], after_text
        models = {lm.manifest.name: lm.manifest for r in load_paths([tmp_path])
                  for lm in r.models}
        assert sorted(models) == sorted(names), after_text
        assert models[names[k]].metadata.labels == {"tier": "batch"}
        # delete document k: the others stay as they were, and parse the same
        assert delete_model(tmp_path, names[k]) == str(f)
        if len(names) == 1:
            assert not f.exists()
            return
        rest = _docs_text(f.read_text())
        assert rest == [d for i, d in enumerate(before) if i != k], f.read_text()
        left = [lm.manifest.name for r in load_paths([tmp_path]) for lm in r.models]
        assert left == [n for i, n in enumerate(names) if i != k]

    check()


def test_concurrent_applies_and_deletes_of_one_file_lose_nothing(tmp_path):
    """Apply and delete run on the server's thread pool: on one file they take turns."""
    from concurrent.futures import ThreadPoolExecutor

    f = tmp_path / "pair.yaml"
    for _ in range(10):
        f.write_text(doc("s1") + "---\n" + doc("s2"))
        with ThreadPoolExecutor(8) as pool:
            jobs = [pool.submit(apply_text, tmp_path, doc("s2", aliases=[f"v{i}"]))
                    for i in range(6)]
            gone = pool.submit(delete_model, tmp_path, "s1")
            [j.result() for j in jobs]  # none raises (FileNotFoundError before)
            assert gone.result() == str(f)
        models = {lm.manifest.name: lm.manifest for r in load_paths([tmp_path])
                  for lm in r.models}
        assert sorted(models) == ["s2"] and len(models["s2"].spec.aliases) == 1


@pytest.mark.parametrize("name", [
    "evil\n", "tiny\u200b", "ｔｉｎｙ", "ti\u00adny", "t\u0456ny", "a" * 64, "-a", "a_b", "",
    "../x", "/tmp/victim"])
def test_model_names_are_plain_dns_labels_checked_whole(name):
    r = parse_text(doc(name=json.dumps(name)), "m.yaml")
    assert r.errors and r.errors[0].field == "metadata.name", (name, r.errors)
    assert "\n" not in str(r.errors[0]), "the error must not carry the raw newline"


@pytest.mark.parametrize("alias", [
    "tiny\u200b", "ｇｐｔ-4", "gpt\n", "a b", "x/../y", "\u0456", "a" * 129])
def test_aliases_refuse_confusables_and_control_characters(alias):
    r = parse_text(doc(aliases=[alias]), "m.yaml")
    assert r.errors and "spec.aliases" in r.errors[0].field, (alias, r.errors)


def test_the_names_people_use_still_parse():
    r = parse_text(doc(name="qwen3-8b", aliases=["gpt-4o-mini", "qwen3:8b", "claude-*",
                                                  "mlx-community/Qwen3-8B", "gpt-4.1",
                                                  "llama3.1:latest", "m[0-9]"]), "m.yaml")
    assert not r.errors, r.errors


def test_client_strings_in_log_lines_are_escaped_and_short():
    from mlxfleet.names import loggable

    line = loggable("evil\n2026-01-01 INFO forged")
    assert "\n" not in line and "\\n" in line
    assert len(loggable("x" * 30_000_000)) < 260
