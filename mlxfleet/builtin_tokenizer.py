"""The builtin models' shared text side: a BPE tokenizer trained on a deterministic
corpus, the ChatML template and ``tokenizer_config.json``.

A leaf module: ``builtin`` (Qwen3 checkpoints), ``builtin_vlm`` and ``scripted``
all build on it without importing one another.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

#: Bump when the generated builtin files change, so stale caches are rebuilt.
BUILTIN_FORMAT = 1
CONTEXT_LENGTH = 2048
VOCAB_SIZE = 2048

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
]

# A ChatML template in the style of Qwen2.5/Qwen3: tools are listed in the
# system turn, calls are <tool_call>{json}</tool_call>, results come back as
# <tool_response> inside a user turn.
CHAT_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls | default([], true) %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this "
    "have from or one had by word but not what all were we when your can said there "
    "use an each which she do how their if will up other about out many then them "
    "these so some her would make like him into time has look two more write go see "
    "number no way could people my than first water been call who oil its now find "
    "long down day did get come made may part hello world model answer question "
    "weather city capital Paris Tokyo London Berlin Rome Madrid red green blue yellow "
    "user assistant system tool function name arguments result json true false null "
    "please thanks yes sure here is the answer today tomorrow temperature degrees "
    "search time zone country France Japan England Germany Italy Spain number plus "
    "minus equals what's it's I'm don't can't"
).split()


def corpus() -> list[str]:
    """A deterministic corpus: words, numbers, punctuation, chat and JSON markup."""
    rng = np.random.default_rng(1234)
    lines = []
    for _ in range(4000):
        n = int(rng.integers(3, 16))
        words = [_WORDS[int(i)] for i in rng.integers(0, len(_WORDS), n)]
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    lines += [str(i) for i in range(1000)]
    lines += [
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\nHi there.<|im_end|>",
        "def f(x):\n    return x + 1\n",
        "Unicode: café naïve résumé über 東京 日本 こんにちは 🙂 ✓ — “quotes”",
    ] * 20
    return lines


def train_tokenizer(corpus: list[str], vocab_size: int, specials: Optional[list[str]] = None):
    """A byte-level BPE (GPT-2/Qwen style) trained on ``corpus``, with our special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials or SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def tokenizer_config(ids: dict[str, int], chat_template: str, context: int) -> dict:
    """``tokenizer_config.json`` for our BPE tokenizers: ChatML special tokens (``ids``:
    token -> id), the tool and reasoning markers added but visible."""
    not_special = {"<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>",
                   "</tool_response>"}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
        "added_tokens_decoder": {
            str(i): {"content": t, "special": t not in not_special, "lstrip": False,
                     "rstrip": False, "normalized": False, "single_word": False}
            for t, i in ids.items()
        },
    }
