#!/usr/bin/env python3
"""Builds tiny random-weight `qwen4_exp_text` (Qwen3.8-Flash-Next) checkpoints and their
reference outputs, the golden fixtures of `crates/engine/tests/qwen4_exp_text_fixtures.rs`.

Regenerate (torch + transformers 5.17, CPU, under a minute):

    /work/venv-ref/bin/python tools/make_fixtures_qwen4_exp.py --out crates/engine/tests/fixtures

Each fixture folder `qwen4_exp_text/<name>/` holds a loadable F32 checkpoint written by
`save_pretrained` (the PLE n-gram table in `split_ngram_parts` shards, as the real checkpoint),
plus `expected.json` (prompts, greedy continuations from `generate(do_sample=False)`, and the
per-block reference values the Rust unit tests check: n-gram ids, QSA selections, mixer, MoE
and PLE outputs) and `logits_<i>.f32` (little-endian float32 `[prompt_len, vocab]` from one
full forward without cache).

The configs are tiny but exercise every Flash-Next block: PLE on a GDN layer (with an eos in
a prompt, which resets the n-gram context), hyper-connections, more experts than top-k, and a
QSA budget of 8 tokens in blocks of 4, so prompts of 40 and 100 tokens run far past it (a
query sees the top 2 blocks plus its tail). Fixture `per_expert` rewrites the fused expert
tensors into `experts.{e}.{gate,up,down}_proj.weight`, the layout published checkpoints use,
and adds `mtp.*` and `model.visual.*` tensors that the engine must accept and ignore.

Before writing, the script checks transformers against itself (cached prefill + one-token
decode reproduces the full forward; generate equals argmax of fresh full forwards), and
requires every greedy step and every QSA top-k boundary to win by a clear margin, so results
within the Rust tolerances cannot flip a token or a block choice (the seed is bumped until so).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import DynamicCache, GenerationConfig
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForCausalLM
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

LOGIT_TOLERANCE = 1e-3
MIN_GREEDY_MARGIN = 2 * LOGIT_TOLERANCE + 1e-3
MIN_BLOCK_MARGIN = 1e-3
NEW_TOKENS = 14
EOS = 2


def base_config(**overrides) -> dict:
    cfg = dict(
        vocab_size=160,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        output_gate_type="sigmoid",
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        hc_count=3,
        hc_lowrank=8,
        ple_layer_ids=[1],
        ple_embed_dim=16,
        ple_conv_kernel_size=4,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=50,
        make_ngram_vocab_size_divisible_by=8,
        seed=1234,
        split_ngram_parts=3,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=8,
        indexer_budget=8,
        indexer_compress_ratio=4,
        eos_token_id=EOS,
        bos_token_id=None,
        pad_token_id=None,
    )
    cfg.update(overrides)
    return cfg


FIXTURES = [
    # Fused expert tensors as save_pretrained writes them; one PLE layer; 3 streams.
    dict(name="fused", seed=11, lengths=(7, 40, 100), eos_in=1, config=base_config(indexer_n_heads=6)),
    # Per-expert tensors, two PLE layers, 4 streams, top-3 of 8 experts, wider indexer.
    dict(
        name="per_expert",
        seed=23,
        lengths=(100, 13, 33),
        eos_in=0,
        config=base_config(
            hc_count=4,
            num_experts=8,
            num_experts_per_tok=3,
            ple_layer_ids=[1, 3],
            indexer_n_heads=8,
            indexer_head_dim=12,
            indexer_budget=12,
            split_ngram_parts=4,
            seed=77,
        ),
    ),
]


def randomise(model, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            leaf = name.rsplit(".", 2)
            if name.endswith("A_log"):
                a = torch.exp(torch.empty(p.shape).uniform_(math.log(0.005), math.log(2.0), generator=gen))
                p.copy_(torch.log(a))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-2.0, 1.0, generator=gen))
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + torch.empty(p.shape).uniform_(-0.3, 0.3, generator=gen))
            elif ("norm" in leaf[-2] or "layernorm" in leaf[-2]) and p.dim() == 1:
                p.copy_(torch.empty(p.shape).uniform_(-0.3, 0.3, generator=gen))
            elif name.endswith("embed_tokens.weight") or name.endswith("ngram_embedding.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[2]))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            else:
                raise SystemExit(f"make_fixtures_qwen4_exp: no init rule for {name} {tuple(p.shape)}")


@torch.no_grad()
def full_logits(model, ids):
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


@torch.no_grad()
def incremental_logits(model, ids, first):
    cache = DynamicCache(config=model.config)
    parts = []
    out = model(input_ids=torch.tensor([ids[:first]]), past_key_values=cache, use_cache=True)
    parts.append(out.logits[0])
    for t in range(first, len(ids)):
        out = model(input_ids=torch.tensor([[ids[t]]]), past_key_values=out.past_key_values, use_cache=True)
        parts.append(out.logits[0])
    return torch.cat(parts).float()


@torch.no_grad()
def greedy(model, ids):
    gc = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=0,
                          eos_token_id=None, pad_token_id=0, bos_token_id=None)
    out = model.generate(input_ids=torch.tensor([ids]), generation_config=gc, use_cache=True)
    return out[0, len(ids):].tolist()


@torch.no_grad()
def greedy_without_cache(model, ids):
    seq, margin = list(ids), float("inf")
    for _ in range(NEW_TOKENS):
        top = torch.topk(full_logits(model, seq)[-1], 2)
        margin = min(margin, float(top.values[0] - top.values[1]))
        seq.append(int(top.indices[0]))
    return seq[len(ids):], margin


class Recorder:
    """Captures block inputs and outputs of one full forward through forward hooks."""

    def __init__(self, model):
        self.values = {}
        self.block_margin = float("inf")
        self.handles = []
        m = model.model
        for li, layer in enumerate(m.layers):
            self.hook(layer.attn_hyper_connection, f"layer{li}.attn_hc")
            self.hook(layer.mlp, f"layer{li}.mlp")
            if layer.ple is not None:
                self.hook(layer.ple, f"layer{li}.ple", with_args=True)
                self.hook(layer.ple.ple_embedding.ngram_embedding, f"layer{li}.ngram_ids")
            if layer.layer_type != "linear_attention":
                self.hook(layer.self_attn.indexer, f"layer{li}.indexer")
                self.hook(layer.self_attn, f"layer{li}.attn")
                self.wrap_topk(layer.self_attn.indexer)
        self.hook(m.hyper_connection_mixer, "final_mixer")

    def hook(self, module, key, with_args=False):
        def fn(mod, args, out):
            self.values[key] = (tuple(a for a in args if isinstance(a, torch.Tensor)), out)
        self.handles.append(module.register_forward_hook(fn))

    def wrap_topk(self, indexer):
        # Measure how close the QSA top-k boundary is to a tie, so float noise cannot flip it.
        recorder = self

        class Guard:
            def __enter__(self):
                self.orig = torch.Tensor.topk

                def topk(t, k, dim=-1, *a, **kw):
                    if t.dim() == 1 and t.shape[0] > k:
                        s = torch.sort(t, descending=True).values
                        recorder.block_margin = min(recorder.block_margin, float(s[k - 1] - s[k]))
                    return self.orig(t, k, dim, *a, **kw)

                torch.Tensor.topk = topk

            def __exit__(self, *exc):
                torch.Tensor.topk = self.orig

        orig_forward = indexer.forward

        def forward(*args, **kwargs):
            with Guard():
                return orig_forward(*args, **kwargs)

        indexer.forward = forward

    def remove(self):
        for h in self.handles:
            h.remove()


def rows(t: torch.Tensor, picks) -> list:
    t = t.reshape(-1, t.shape[-1])
    return [[float(v) for v in t[i]] for i in picks]


def block_values(rec: Recorder, cfg, n: int) -> dict:
    picks = sorted({0, 1, n // 2, n - 1})
    out = {"rows": picks}
    for key, (args, res) in rec.values.items():
        if key.endswith("attn_hc") or key == "final_mixer":
            if isinstance(res, tuple):
                mixed, _, inject = res
                out[key] = {"input": rows(args[0], picks), "mixed": rows(mixed, picks),
                            "inject": rows(inject, picks)}
            else:
                out[key] = {"input": rows(args[0], picks), "mixed": rows(res, picks)}
        elif key.endswith(".mlp"):
            out[key] = {"input": rows(args[0], picks), "output": rows(res, picks)}
        elif key.endswith(".ple"):
            # args: hidden_states, input_ids
            out[key] = {"input": rows(args[0], picks), "output": rows(res, picks)}
        elif key.endswith("ngram_ids"):
            ids = args[0].reshape(-1, args[0].shape[-1])
            out[key] = [[int(v) for v in ids[i]] for i in range(ids.shape[0])]
        elif key.endswith(".attn"):
            # Every row: the indexer's keys of all tokens decide each query's blocks.
            x = args[0].reshape(-1, args[0].shape[-1])
            out[key] = {"input": rows(x, range(x.shape[0]))}
        elif key.endswith("indexer"):
            mask = res[0, 0]  # [q, kv] bool
            out[key] = [[int(j) for j in torch.nonzero(mask[i]).flatten()] for i in range(mask.shape[0])]
    return out


def make_prompts(vocab, lengths, eos_in, gen):
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    # An eos inside a prompt: the n-gram context must restart after it.
    p = prompts[eos_in]
    p[len(p) // 2] = EOS
    return prompts


def to_per_expert(folder: Path, cfg: dict, gen: torch.Generator) -> None:
    """Rewrites fused experts as per-expert tensors and adds mtp/vision tensors to skip."""
    path = folder / "model.safetensors"
    if not path.exists():
        raise SystemExit("make_fixtures_qwen4_exp: expected a single model.safetensors")
    tensors = load_file(str(path))
    out = {}
    inter = cfg["moe_intermediate_size"]
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    h = cfg["hidden_size"]
    out["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.randn(inter, h, generator=gen)
    out["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen)
    out["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 4, 4, generator=gen)
    save_file(out, str(path), metadata={"format": "pt"})


def build(fx: dict, out_root: Path, command: str) -> None:
    seed = fx["seed"]
    while True:
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        config = Qwen4ExpTextConfig(**fx["config"])
        config._attn_implementation = "eager"
        model = Qwen4ExpForCausalLM(config).eval()
        randomise(model, gen)
        # Larger logits make clear greedy winners.
        with torch.no_grad():
            model.lm_head.weight.mul_(4.0)
        # generate() must not stop at the fixtures' eos: the continuations have a fixed length.
        model.generation_config.eos_token_id = None
        prompts = make_prompts(config.vocab_size, fx["lengths"], fx["eos_in"], gen)
        ok, margin_seen, block_margin = True, float("inf"), float("inf")
        records, logits_all, continuations = [], [], []
        # Cheap checks first: the greedy margins and the QSA block margins.
        for ids in prompts:
            rec = Recorder(model)
            full_logits(model, ids)
            rec.remove()
            block_margin = min(block_margin, rec.block_margin)
        if block_margin >= MIN_BLOCK_MARGIN:
            for ids in prompts:
                margin_seen = min(margin_seen, greedy_without_cache(model, ids)[1])
        if margin_seen < MIN_GREEDY_MARGIN or block_margin < MIN_BLOCK_MARGIN:
            print(f"{fx['name']}: seed {seed}: greedy margin {margin_seen:.2e}, block margin {block_margin:.2e}; retrying", flush=True)
            seed += 1
            continue
        for ids in prompts:
            rec = Recorder(model)
            full = full_logits(model, ids)
            rec.remove()
            block_margin = min(block_margin, rec.block_margin)
            records.append(block_values(rec, config, len(ids)))
            inc = incremental_logits(model, ids, max(1, len(ids) // 3))
            diff = float((inc - full).abs().max())
            if diff > 1e-4:
                raise SystemExit(f"{fx['name']}: transformers' cached decode differs from its full forward by {diff}")
            tokens = greedy(model, ids)
            nocache, margin = greedy_without_cache(model, ids)
            if tokens != nocache:
                raise SystemExit(f"{fx['name']}: generate gave {tokens}, argmax without cache {nocache}")
            logits_all.append(full)
            continuations.append(tokens)
        break

    folder = out_root / "qwen4_exp_text" / fx["name"]
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    model.save_pretrained(folder, safe_serialization=True)
    model.generation_config.save_pretrained(folder)
    if fx["name"] == "per_expert":
        to_per_expert(folder, fx["config"], gen)
    for i, lg in enumerate(logits_all):
        np.asarray(lg, dtype="<f4").tofile(folder / f"logits_{i}.f32")

    m0 = model.model.layers[0].ple.ple_embedding
    expected = {
        "prompts": prompts,
        "greedy": continuations,
        "vocab_size": config.vocab_size,
        "seed": seed,
        "min_greedy_margin": margin_seen,
        "min_qsa_block_margin": block_margin,
        "ngram": {
            "layer_multipliers": [int(v) for v in m0.layer_multipliers],
            "head_vocab_sizes": [int(v) for v in m0.ngram_heads_vocab_sizes],
            "head_offsets": [int(v) for v in m0.ngram_heads_offsets],
            "table_rows": int(m0.ngram_embedding.weight.shape[0]),
        },
        "blocks": records,
        "generated_by": {
            "command": command,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "greedy": f"model.generate(do_sample=False, use_cache=True, max_new_tokens={NEW_TOKENS}), one prompt at a time",
        },
    }
    (folder / "expected.json").write_text(json.dumps(expected, indent=None, separators=(",", ":")) + "\n")
    names = sorted(load_file(str(folder / "model.safetensors")).keys())
    print(f"{fx['name']}: seed {seed}, greedy margin {margin_seen:.3g}, block margin {block_margin:.3g}, "
          f"{len(names)} tensors, ngram shards: {[n for n in names if 'shard' in n][:2]}…", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="fixtures root (crates/engine/tests/fixtures)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    command = "python tools/make_fixtures_qwen4_exp.py --out crates/engine/tests/fixtures"
    for fx in FIXTURES:
        build(fx, args.out, command)


if __name__ == "__main__":
    main()
