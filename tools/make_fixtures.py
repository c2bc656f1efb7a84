#!/usr/bin/env python3
"""Builds tiny random-weight `qwen3_5_text` checkpoints and their reference outputs.

The outputs are the golden fixtures of `crates/engine/tests/qwen3_5_text_fixtures.rs`: the
engine must reproduce the logits and greedy continuations that Hugging Face `transformers`
computes on these checkpoints.

Regenerate (needs torch and transformers 5.17; a CPU is enough, about a minute):

    python tools/make_fixtures.py --out crates/engine/tests/fixtures

(here: `/work/venv-ref/bin/python tools/make_fixtures.py --out crates/engine/tests/fixtures`).
The script is deterministic: the same versions of torch and transformers write the same bytes.

Every fixture folder `qwen3_5_text/<name>/` holds:
- `config.json`, `model.safetensors`, `generation_config.json`: a loadable checkpoint (F32);
- `expected.json`: the prompts (token ids), the greedy continuation of each prompt as
  `model.generate(do_sample=False, use_cache=True)` produces it, the smallest top-1/top-2
  logit margin met along that continuation, and the versions and command that made it;
- `logits_<i>.npy`: float32 `[prompt_len, vocab]`, the logits of every position of prompt `i`
  from one full forward pass (no cache).

Weights are not transformers' default init: with std 0.02 everywhere, norms at their defaults
and `dt_bias` at 1, most parameters would barely change the logits, so a loader that misreads
them would still pass. Here every parameter has a visible effect: linear weights have
std 1/sqrt(fan_in), norm weights are perturbed, the GDN decays (`A_log`, `dt_bias`) are spread
from fast to slow forgetting (slow ones keep the recurrent state alive across 64-token chunks),
and the conv taps are random.

Before writing, the script checks transformers against itself: incremental decoding with the
cache (prefill of part of the prompt, then one token at a time) must reproduce the full
forward's logits, and greedy decoding without the cache must reproduce `generate`. It also
requires every greedy step to win by a margin larger than twice the Rust test's logit tolerance,
so that logits within tolerance imply identical tokens (the seed is bumped until it does), and
that redrawing any single tensor moves the logits by more than 20 times that tolerance.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import GenerationConfig, Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5TextConfig

# The Rust test compares logits with this tolerance; greedy margins must exceed twice it.
LOGIT_TOLERANCE = 1e-3
MIN_GREEDY_MARGIN = 2 * LOGIT_TOLERANCE + 1e-3
PROMPT_LENGTHS = (5, 70, 150)  # 70 and 150 cross the 64-token chunks of the GDN prefill
NEW_TOKENS = 16


@dataclass
class Fixture:
    name: str
    description: str
    seed: int
    config: dict
    # Write the tensors under the published multimodal names (`model.language_model.*`) with a
    # `model_type: qwen3_5` wrapper config.
    multimodal_layout: bool = False
    prompt_lengths: tuple = PROMPT_LENGTHS
    extra: dict = field(default_factory=dict)


def base_config(**overrides) -> dict:
    cfg = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg.update(overrides)
    return cfg


def rope(partial: float, sections: list[int], theta: float = 10000.0) -> dict:
    return {
        "rope_type": "default",
        "rope_theta": theta,
        "partial_rotary_factor": partial,
        "mrope_section": sections,
        "mrope_interleaved": True,
    }


FIXTURES = [
    Fixture(
        name="gqa4x2_gdn2x4_rot25",
        description="4 query / 2 KV heads, GDN 2 key / 4 value heads, partial rotary 0.25, "
        "4 layers (full attention at layer 3), untied lm_head",
        seed=1000,
        config=base_config(),
    ),
    Fixture(
        name="gqa4x1_gdn2x2_rot50_8layers",
        description="4 query / 1 KV head, GDN 2 key / 2 value heads, partial rotary 0.5, "
        "8 layers (full attention at 3 and 7), hidden 48, vocab 320",
        seed=2000,
        config=base_config(
            vocab_size=320,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=12,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=12,
            linear_value_head_dim=8,
            rope_parameters=rope(0.5, [1, 1, 1], theta=1_000_000.0),
        ),
    ),
    Fixture(
        name="mha2x2_tied_layer_types",
        description="2 query / 2 KV heads, GDN 2 key / 4 value heads, tied embeddings, explicit "
        "layer_types [linear, full, linear, linear, full], hidden 32",
        seed=3000,
        config=base_config(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=5,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            tie_word_embeddings=True,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
            ],
        ),
    ),
    Fixture(
        name="multimodal_layout_gqa3x1_gdn1x3",
        description="published multimodal layout (model.language_model.*, model_type qwen3_5 "
        "wrapping text_config); 3 query / 1 KV head, GDN 1 key / 3 value heads, head_dim 32 "
        "(8 rotary dims), 6 layers, hidden 64, vocab 384",
        seed=4000,
        multimodal_layout=True,
        config=base_config(
            vocab_size=384,
            hidden_size=64,
            intermediate_size=112,
            num_hidden_layers=6,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=32,
            linear_num_key_heads=1,
            linear_num_value_heads=3,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            rope_parameters=rope(0.25, [2, 1, 1]),
        ),
    ),
]


def init_value(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """The random value of one parameter (see the module docstring for why not the default)."""
    leaf = name.rsplit(".", 2)
    if name.endswith("A_log"):
        # Decay rates from fast (A = 2) to very slow (A = 0.005) forgetting.
        return torch.empty(shape).uniform_(math.log(0.005), math.log(2.0), generator=gen)
    if name.endswith("dt_bias"):
        return torch.empty(shape).uniform_(-2.0, 1.0, generator=gen)
    if name.endswith("conv1d.weight"):
        return torch.randn(shape, generator=gen) * 0.5
    if name.endswith("linear_attn.norm.weight"):
        # The gated norm scales by w (not 1 + w).
        return 1.0 + torch.empty(shape).uniform_(-0.3, 0.3, generator=gen)
    if "norm" in leaf[-2] and len(shape) == 1:
        # (1 + w) norms: w is an offset from 1.
        return torch.empty(shape).uniform_(-0.3, 0.3, generator=gen)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    if len(shape) == 2:
        return torch.randn(shape, generator=gen) / math.sqrt(shape[1])
    raise SystemExit(f"make_fixtures: no init rule for parameter {name} {tuple(shape)}")


def randomise(model: Qwen3_5ForCausalLM, gen: torch.Generator) -> None:
    """Gives every parameter a value that visibly changes the logits."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.copy_(init_value(name, p.shape, gen))
        if model.config.tie_word_embeddings:
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@torch.no_grad()
def least_tensor_effect(model, ids: list[int]) -> tuple[float, str]:
    """Redraws each parameter tensor in turn (then puts it back) and returns the smallest
    change of the logits seen, with the tensor's name: a loader that misreads any one tensor
    must move the logits far beyond the test's tolerance."""
    base = full_logits(model, ids)
    gen = torch.Generator().manual_seed(12345)
    least = (float("inf"), "")
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        old = p.detach().clone()
        p.copy_(init_value(name, p.shape, gen))
        least = min(least, (float((full_logits(model, ids) - base).abs().max()), name))
        p.copy_(old)
    return least


def make_prompts(vocab: int, lengths, gen: torch.Generator) -> list[list[int]]:
    # Avoid the special ids 0..2 so that the prompts look like text.
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def full_logits(model, ids: list[int]) -> torch.Tensor:
    out = model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def incremental_logits(model, ids: list[int], first: int) -> torch.Tensor:
    """Prefills `first` tokens with the cache, then feeds one token at a time."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    parts = []
    out = model(input_ids=torch.tensor([ids[:first]]), past_key_values=cache, use_cache=True)
    parts.append(out.logits[0])
    for t in range(first, len(ids)):
        out = model(
            input_ids=torch.tensor([[ids[t]]]),
            past_key_values=out.past_key_values,
            use_cache=True,
        )
        parts.append(out.logits[0])
    return torch.cat(parts).float()


@torch.no_grad()
def greedy(model, ids: list[int]) -> list[int]:
    gc = GenerationConfig(
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
    )
    out = model.generate(input_ids=torch.tensor([ids]), generation_config=gc, use_cache=True)
    return out[0, len(ids):].tolist()


@torch.no_grad()
def greedy_without_cache(model, ids: list[int]) -> tuple[list[int], float]:
    """Argmax of a fresh full forward at each step; returns the tokens and the smallest
    top-1 minus top-2 logit margin met."""
    seq = list(ids)
    margin = float("inf")
    for _ in range(NEW_TOKENS):
        last = full_logits(model, seq)[-1]
        top = torch.topk(last, 2)
        margin = min(margin, float(top.values[0] - top.values[1]))
        seq.append(int(top.indices[0]))
    return seq[len(ids):], margin


def multimodal_config(text_cfg: Qwen3_5TextConfig) -> dict:
    text = text_cfg.to_dict()
    for k in ("architectures", "transformers_version", "dtype"):
        text.pop(k, None)
    wrapper = Qwen3_5Config(text_config=text)
    d = wrapper.to_dict()
    d["architectures"] = ["Qwen3_5ForConditionalGeneration"]
    return d


def to_multimodal_name(name: str) -> str:
    if name.startswith("model."):
        return "model.language_model." + name[len("model."):]
    return name


def build(fx: Fixture, out_root: Path, command: str) -> dict:
    attempt = 0
    while True:
        seed = fx.seed + attempt
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed)
        cfg = Qwen3_5TextConfig(**fx.config)
        cfg._attn_implementation = "eager"
        model = Qwen3_5ForCausalLM(cfg).eval()
        model.config._attn_implementation = "eager"
        randomise(model, gen)
        prompts = make_prompts(cfg.vocab_size, fx.prompt_lengths, gen)
        results = []
        ok = True
        for ids in prompts:
            logits = full_logits(model, ids)
            tokens, margin = greedy_without_cache(model, ids)
            results.append((ids, logits, tokens, margin))
            if margin < MIN_GREEDY_MARGIN:
                ok = False
        if ok:
            break
        attempt += 1
        print(f"  {fx.name}: seed {seed} gives a greedy margin below {MIN_GREEDY_MARGIN}; trying {seed + 1}")
        if attempt > 50:
            raise SystemExit(f"make_fixtures: {fx.name}: no seed with a clear greedy path")

    # Sanity: transformers' cached paths agree with its full forward.
    worst_incremental = 0.0
    for ids, logits, tokens, _ in results:
        for first in sorted({1, min(len(ids), 7), min(len(ids), 64), len(ids) - 1} - {0}):
            inc = incremental_logits(model, ids, first)
            worst_incremental = max(worst_incremental, float((inc - logits).abs().max()))
        gen_tokens = greedy(model, ids)
        if gen_tokens != tokens:
            raise SystemExit(
                f"make_fixtures: {fx.name}: generate() gave {gen_tokens}, greedy without cache {tokens}"
            )
    if worst_incremental > 1e-4:
        raise SystemExit(
            f"make_fixtures: {fx.name}: transformers' cached decode differs from its full forward "
            f"by {worst_incremental:.3g}"
        )

    least_effect, least_name = least_tensor_effect(model, results[1][0])
    if least_effect < 20 * LOGIT_TOLERANCE:
        raise SystemExit(
            f"make_fixtures: {fx.name}: redrawing {least_name} changes the logits by only "
            f"{least_effect:.3g}; the fixture would not catch a misread tensor"
        )

    folder = out_root / "qwen3_5_text" / fx.name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    if fx.multimodal_layout:
        state = {to_multimodal_name(k): v.contiguous() for k, v in model.state_dict().items()}
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(dict(sorted(state.items())), str(folder / "model.safetensors"), metadata={"format": "pt"})
        with open(folder / "config.json", "w") as f:
            json.dump(multimodal_config(cfg), f, indent=2, sort_keys=True)
            f.write("\n")
        model.generation_config.save_pretrained(folder)
    else:
        model.save_pretrained(folder, safe_serialization=True)
    strip_versions(folder)

    prompts_json = []
    for i, (ids, logits, tokens, margin) in enumerate(results):
        np.save(folder / f"logits_{i}.npy", logits.numpy().astype("<f4"), allow_pickle=False)
        prompts_json.append(
            {
                "token_ids": ids,
                "logits_file": f"logits_{i}.npy",
                "logits_shape": list(logits.shape),
                "greedy_new_tokens": tokens,
                "greedy_min_margin": round(margin, 6),
            }
        )
    expected = {
        "fixture": fx.name,
        "description": fx.description,
        "seed": seed,
        "multimodal_layout": fx.multimodal_layout,
        "vocab_size": cfg.vocab_size,
        "logit_tolerance": LOGIT_TOLERANCE,
        "greedy": f"model.generate(do_sample=False, use_cache=True, max_new_tokens={NEW_TOKENS}), "
        "no end-of-sequence stop",
        "generated_by": {
            "command": command,
            "transformers": transformers.__version__,
            "torch": torch.__version__.split("+")[0],
            "attn_implementation": "eager",
            "transformers_cached_decode_max_abs_diff": float(f"{worst_incremental:.3g}"),
            "least_logit_change_when_one_tensor_is_redrawn": float(f"{least_effect:.3g}"),
        },
        "prompts": prompts_json,
    }
    with open(folder / "expected.json", "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(
        f"  {fx.name}: seed {seed}, {size / 1024:.0f} KiB, cached-decode Δ {worst_incremental:.2g}, "
        f"min greedy margin {min(r[3] for r in results):.3g}, least tensor effect {least_effect:.3g} ({least_name})"
    )
    return expected


def strip_versions(folder: Path) -> None:
    """Drops the transformers version stamp from the JSON files so that regenerating with a
    patch release does not churn them (the version is kept in expected.json)."""
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if not path.exists():
            continue
        d = json.loads(path.read_text())
        d.pop("transformers_version", None)
        if isinstance(d.get("text_config"), dict):
            d["text_config"].pop("transformers_version", None)
        path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="fixture root, e.g. crates/engine/tests/fixtures")
    ap.add_argument("--only", action="append", help="build only this fixture (repeatable)")
    args = ap.parse_args()
    if not transformers.__version__.startswith("5.17"):
        print(f"warning: written for transformers 5.17, found {transformers.__version__}", file=sys.stderr)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # reductions in one fixed order, so reruns give the same bytes
    repo_root = Path(__file__).resolve().parent.parent
    command = "python tools/make_fixtures.py --out " + os.path.relpath(args.out.resolve(), repo_root)
    print(f"writing fixtures under {args.out}")
    for fx in FIXTURES:
        if args.only and fx.name not in args.only:
            continue
        build(fx, args.out, command)


if __name__ == "__main__":
    main()
