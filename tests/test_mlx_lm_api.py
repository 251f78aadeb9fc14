"""The mlx-lm API the engine is written against. When mlx-lm moves, this fails first and
names what moved (pyproject pins the tested range)."""

from __future__ import annotations

import inspect
import json

import pytest


def _params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_batch_generator_api():
    from mlx_lm.generate import BatchGenerator

    assert {"stop_tokens", "completion_batch_size", "prefill_batch_size",
            "prefill_step_size", "stream"} <= _params(BatchGenerator.__init__)
    assert {"prompts", "max_tokens", "caches", "all_tokens", "samplers",
            "logits_processors", "stop_sequences"} <= _params(BatchGenerator.insert), \
        "BatchGenerator.insert changed: engine._insert must follow"
    for name in ("next", "remove"):
        assert callable(getattr(BatchGenerator, name, None)), f"BatchGenerator.{name} is gone"
    resp = getattr(BatchGenerator, "Response", None)
    fields = set(getattr(resp, "__dataclass_fields__", {}) or getattr(resp, "_fields", ()))
    if fields:  # the engine reads these off every response
        assert {"uid", "token", "logprobs", "finish_reason", "prompt_cache",
                "all_tokens"} <= fields


@pytest.mark.parametrize("module, names", [
    ("mlx_lm.generate", ["StopSequences", "TextStateMachine", "BatchGenerator"]),
    ("mlx_lm.sample_utils", ["make_sampler", "make_logits_processors", "apply_top_p",
                             "apply_min_p", "apply_top_k"]),
    ("mlx_lm.models.cache", ["PromptTrie", "can_trim_prompt_cache", "trim_prompt_cache",
                             "make_prompt_cache"]),
    ("mlx_lm", ["load"]),
])
def test_names_the_worker_imports(module, names):
    import importlib

    m = importlib.import_module(module)
    missing = [n for n in names if not hasattr(m, n)]
    assert not missing, f"{module} no longer has {missing}"


def test_prompt_trie_search_result():
    from mlx_lm.models.cache import PromptTrie

    t = PromptTrie()
    t.add("m", [1, 2, 3], "v")
    r = t.search("m", [1, 2, 3, 4])
    assert (r.exact, r.shorter, r.common_prefix) == (None, [1, 2, 3], 3)
    r = t.search("m", [1, 2, 9])
    assert r.longer == [1, 2, 3] and r.common_prefix == 2
    assert t.search("m", [1, 2, 3]).exact == [1, 2, 3]
    assert t.pop_prefixes("m", [1, 2, 3]) == []


def test_text_state_machine_finds_stop_strings():
    from mlx_lm.generate import TextStateMachine

    sm = TextStateMachine({"normal": [("END", None)]})
    state, segments = TextStateMachine.split(sm.make_state(), "abcEN")
    state, more = TextStateMachine.split(state, "Dxyz")
    text = "".join(t for s, t in segments + more if s is not None)
    assert text == "abc" and state[0] is None


def test_mlx_lm_reads_tokenizer_json_only_as_far_as_its_decoder(monkeypatch):
    """Workers start without parsing the vocabulary in tokenizer.json a first time
    (tokenizer_json.py): mlx-lm's loader still gets the detokenizer it would pick, and if
    mlx-lm stops reading the file through its module's ``json.load``, this says so."""
    from mlx_lm.utils import load_tokenizer

    from mlxfleet.sources import resolve_source
    from mlxfleet.worker import tokenizer_json

    read, members_of = [], tokenizer_json.leading_members

    def spy(text, wanted):
        read.append(members := members_of(text, wanted))
        return members

    monkeypatch.setattr(tokenizer_json, "leading_members", spy)
    path = resolve_source("builtin:tiny")
    whole = load_tokenizer(path)
    with tokenizer_json.quick_tokenizer_json():
        quick = load_tokenizer(path)
    assert read and "decoder" in read[0] and "model" not in read[0], read
    assert type(quick.detokenizer) is type(whole.detokenizer)
    assert quick.encode("Hello there") == whole.encode("Hello there")
    from mlx_lm import tokenizer_utils

    assert tokenizer_utils.json is json  # put back after the load


def test_a_load_lists_the_vocabulary_once(monkeypatch):
    """transformers builds ``get_vocab()`` anew on every call (0.1-0.2 s for a real
    vocabulary) and mlx-lm's loader asks three times: during a worker's load it is listed
    once, each caller gets its own copy, and a token added meanwhile is listed."""
    from mlx_lm.utils import load_tokenizer
    from transformers import PreTrainedTokenizerFast as Fast

    from mlxfleet.sources import resolve_source
    from mlxfleet.worker import tokenizer_json

    listed, real = [], Fast.get_vocab

    def counting(tok):
        listed.append(len(tok))
        return real(tok)

    monkeypatch.setattr(Fast, "get_vocab", counting)
    with tokenizer_json.quick_tokenizer_json():
        tok = load_tokenizer(resolve_source("builtin:tiny"))
        vocab = tok.get_vocab()
        assert listed == [len(vocab)]  # mlx-lm's calls and this one: one listing
        vocab["<mine>"] = -1
        assert "<mine>" not in tok.get_vocab()  # a copy each
        tok.add_tokens(["<added>"])
        assert "<added>" in tok.get_vocab() and len(listed) == 2
    assert Fast.get_vocab is counting  # put back after the load
    tok.get_vocab()
    assert len(listed) == 3


@pytest.mark.parametrize("text, members", [
    ('{"version": "1.0", "decoder": {"type": "ByteLevel"}, "model": {"vocab": {"a": 1}}}',
     {"version": "1.0", "decoder": {"type": "ByteLevel"}}),
    ('{"model": {"vocab": {"decoder": 1}}, "decoder": null}',  # after the model: all of it
     {"model": {"vocab": {"decoder": 1}}, "decoder": None}),
    ('{"model": {}}', None),  # none: the file is read whole, as mlx-lm would
    ('{"decoder": {"type": "Metaspace", "replacement": "\\u2581"}, "model": {"vocab": {"a',
     {"decoder": {"type": "Metaspace", "replacement": "\u2581"}}),  # cut past it: enough
    ('{"version": "1.0", "decoder": {"type": "Metasp', None),  # cut inside it
    ('[1, 2]', None),
])
def test_leading_members_stop_at_the_one_wanted(text, members):
    from mlxfleet.worker.tokenizer_json import leading_members

    assert leading_members(text, "decoder") == members


def test_a_tokenizer_json_laid_out_otherwise_is_read_whole(tmp_path):
    from mlxfleet.worker.tokenizer_json import load_tokenizer_json

    whole = {"model": {"vocab": {"é": 0}}, "decoder": {"type": "ByteLevel"}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(whole, ensure_ascii=False))
    with open(tmp_path / "tokenizer.json", encoding="utf-8") as fp:
        assert load_tokenizer_json(fp) == whole
    (tmp_path / "other.json").write_text('{"decoder": 1, "model": 2}')
    with open(tmp_path / "other.json", encoding="utf-8") as fp:
        assert load_tokenizer_json(fp) == {"decoder": 1, "model": 2}


def test_transformers_import_structure_read_back_is_what_its_walk_finds(tmp_path):
    """Workers keep transformers' folder walk on disk (mlxfleet/transformers_imports.py):
    what they read back must be what transformers itself finds, and a changed
    installation walks again."""
    from importlib.util import find_spec
    from pathlib import Path

    from mlxfleet.transformers_imports import cached

    origin = find_spec("transformers.utils.import_utils").origin
    from transformers.utils import import_utils

    define = import_utils.define_import_structure.__wrapped__
    walks = []

    def walk(path, prefix=None):
        walks.append(path)
        return define(path, prefix)

    models = Path(origin).parent.parent / "models"
    first = cached(walk, Path(origin), tmp_path)(models, "models")
    again = cached(walk, Path(origin), tmp_path)(models, "models")
    assert len(walks) == 1, "the second process reads it back"
    assert first == again == define(models, "models")
    assert len(again[frozenset()]) > 500  # (every model's configuration module, and more)
    # Another installation (here: another folder) is walked, not read.
    other = tmp_path / "pkg" / "models"
    (other / "m").mkdir(parents=True)
    (other / "m" / "configuration_m.py").write_text("__all__ = ['MConfig']\nclass MConfig: ...\n")
    (other / "__init__.py").write_text("")
    got = cached(walk, Path(origin), tmp_path)(other, "models")
    assert len(walks) == 2 and got == define(other, "models")
    (other / "m" / "modeling_m.py").write_text("__all__ = ['MModel']\nclass MModel: ...\n")
    got = cached(walk, Path(origin), tmp_path)(other, "models")
    assert len(walks) == 3 and got == define(other, "models"), \
        "a file added to a model's folder (an upgrade) walks again"
    assert all(oct(p.stat().st_mode)[-3:] == "600" for p in tmp_path.glob("*.json"))
    # A damaged or foreign file is walked past (and written again), never believed.
    for junk in ("{not json", '{"a": 1}', "[[1, 2]]", '[["x", {"m": 3}]]'):
        for p in tmp_path.glob("*.json"):
            p.write_text(junk)
        got = cached(walk, Path(origin), tmp_path)(other, "models")
        assert got == define(other, "models"), junk
    assert len(walks) == 7


def test_a_worker_process_uses_the_cached_import_structure():
    """``install()`` (as a worker runs it) wraps transformers' walk before transformers
    imports it by name, and transformers still imports what mlx-lm asks of it."""
    import subprocess
    import sys

    code = ("from mlxfleet.transformers_imports import install; install()\n"
            "import mlx_lm.tokenizer_utils, transformers\n"
            "from transformers.utils import import_utils as u\n"
            "print(u.define_import_structure.__module__, transformers.GemmaTokenizer.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["mlxfleet.transformers_imports", "GemmaTokenizer"], out
