"""The mlx-lm API the engine is written against. When mlx-lm moves, this fails first and
names what moved (pyproject pins the tested range)."""

from __future__ import annotations

import inspect

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
