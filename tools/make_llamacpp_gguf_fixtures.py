#!/usr/bin/env python3
"""GGUF files written by llama.cpp itself (its convert_hf_to_gguf.py and llama-quantize), with
transformers' logits on their dequantized weights: the fixtures of the `llamacpp_*` tests in
crates/engine/tests/quant_models.rs and of crates/cli/tests/llamacpp_gguf.rs.

    LLAMA_CPP=/path/to/llama.cpp /work/venv-ref/bin/python tools/make_llamacpp_gguf_fixtures.py

Needs (none of it in CI, which reads only the committed files):
- a llama.cpp source tree (LLAMA_CPP; the one vendored in the llama-cpp-python 0.3.36 sdist
  works) with `llama-quantize` built in `$LLAMA_CPP/b/bin/` (or LLAMA_QUANTIZE):
  `cmake -B b -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF && cmake --build b
  --target llama-quantize -j2`;
- torch, transformers 5.17.0, safetensors, numpy (the gguf package used is the tree's own
  gguf-py, which the converter needs and which knows type 42, Q2_0).

For each model of MODELS:
1. a random tiny `qwen3_5_text` checkpoint (tools/make_fixtures.py's value rules) with a
   byte-level BPE tokenizer trained here, saved as F32 safetensors; one model also carries an
   MTP block (`mtp_num_hidden_layers: 1`, `mtp.*` tensors as Qwen3.5 checkpoints name them),
   which transformers ignores and the converter writes as an extra block;
2. convert_hf_to_gguf.py --outtype f32 (the tiny tokenizer's pre-tokenizer hash is not one the
   converter knows: `get_vocab_base_pre` is made to answer "qwen35"; the engine reads no
   tokenizer metadata from GGUF);
3. the converted file's tensors, with the converter's transforms undone by this script, must
   give back the checkpoint (checks the undoing against the real converter);
4. an importance matrix (GGUF imatrix format: `<tensor>.in_sum2`, `<tensor>.counts`) of random
   positive activations, because llama-quantize refuses IQ3_XXS / IQ2_XS without one;
5. llama-quantize with per-tensor `--tensor-type` overrides (mixed Q8_0 / Q2_0 / IQ3_S /
   IQ3_XXS / IQ2_XS), then every tensor of the quantized file dequantized (gguf-py; Q2_0 by
   ggml's dequantize_row_q2_0, which gguf-py lacks), the transforms undone, transformers run
   on that, and the reference written to crates/engine/tests/fixtures/llamacpp_gguf/<name>/:
   model.gguf (as llama-quantize wrote it), tokenizer.json, expected.json, logits_<i>.f32.

Plus `qwen4exp_experts`: tests/fixtures/qwen4_exp_text/fused through the converter's Flash-Next
model (qwen4exp) and llama-quantize (Q8_0 gate/up, F16 down: 16 columns are no whole Q8_0
block); the engine reads only the routed experts of that whole-model file, the rest from the
fixture's safetensors. Reruns write the same bytes.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP = Path(os.environ.get("LLAMA_CPP", "/work/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp"))
QUANTIZE = Path(os.environ.get("LLAMA_QUANTIZE", LLAMA_CPP / "b" / "bin" / "llama-quantize"))
# The tree's gguf-py before any installed gguf package: the converter needs its own version.
sys.path.insert(0, str(LLAMA_CPP / "gguf-py"))
sys.path.insert(0, str(ROOT / "tools"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import gguf  # noqa: E402
from gguf import GGUFReader, GGUFWriter, quants  # noqa: E402
from gguf.constants import GGMLQuantizationType as T  # noqa: E402

import make_quant_model_fixtures as mq  # noqa: E402

OUT = ROOT / "crates" / "engine" / "tests" / "fixtures" / "llamacpp_gguf"
VOCAB = 320

BASE = dict(
    model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"],
    vocab_size=VOCAB, hidden_size=256, intermediate_size=256,
    num_attention_heads=4, num_key_value_heads=1, head_dim=64,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_act="silu", attention_bias=False,
)

# name -> (config changes, MTP layers, llama-quantize arguments). `--tensor-type` patterns are
# regexes searched in the GGUF name, the first match wins; the positional type is the default.
MODELS = {
    "qwen35_untied_mtp": (
        dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], full_attention_interval=2,
             # 3 value heads per key head, as in the 27B (16 / 48): the grouped -> tiled reorder
             # is not its own inverse (with 2 x 2 it would be).
             linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=32, linear_value_head_dim=64,
             tie_word_embeddings=False),
        1,
        ["--tensor-type", r"blk\.2\.=iq2_xs",  # the MTP block: only its size matters
         "--tensor-type", r"blk\.0\.attn_qkv=iq3_s",
         "--tensor-type", r"blk\.0\.attn_gate=iq3_xxs",
         "--tensor-type", r"blk\.0\.ssm_out=q2_0",  # 384 columns: not whole 256-blocks
         "--tensor-type", r"blk\.0\.ffn_gate=iq3_xxs",
         "--tensor-type", r"blk\.0\.ffn_up=iq2_xs",
         "--tensor-type", r"blk\.0\.ffn_down=iq2_xs",
         "--tensor-type", r"blk\.1\.attn_q=iq2_xs",
         "--tensor-type", r"blk\.1\.attn_k=q2_0",
         "--tensor-type", r"blk\.1\.ffn_up=q2_0",
         "--tensor-type", r"blk\.1\.attn_output=iq3_s",
         "--tensor-type", r"blk\.1\.ffn_gate=iq3_s",
         "--tensor-type", r"blk\.1\.ffn_down=iq3_xxs",
         "--output-tensor-type", "iq3_xxs",
         "--token-embedding-type", "q2_0",
         "Q8_0"],
    ),
    # Saved as Qwen3_5ForConditionalGeneration (text_config, model.language_model.*, a vision
    # tensor), the layout of the published Qwen3.8-27B checkpoints the real GGUFs come from.
    "qwen35_tied": (
        dict(vl_layout=True, num_hidden_layers=2, layer_types=["full_attention", "linear_attention"], full_attention_interval=4,
             linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=64,
             tie_word_embeddings=True),
        0,
        ["--tensor-type", r"blk\.0\.attn_q=iq3_xxs",
         "--tensor-type", r"blk\.0\.attn_output=q2_0",
         "--tensor-type", r"blk\.0\.ffn_up=iq2_xs",
         "--tensor-type", r"blk\.1\.attn_qkv=iq3_xxs",
         "--tensor-type", r"blk\.1\.ssm_out=q2_0",
         "--tensor-type", r"blk\.1\.ffn_down=iq2_xs",
         "--tensor-type", r"blk\.1\.ffn_up=iq3_xxs",
         "--tensor-type", r"blk\.0\.ffn_down=iq3_s",
         "--tensor-type", r"ffn_gate=iq3_s",
         "--token-embedding-type", "iq3_s",
         "Q8_0"],
    ),
}

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tiny models make tests fast; quantized weights make them small.",
    "def add(a, b):\n    return a + b\n",
    "llama.cpp writes GGUF files; transformers reads safetensors.",
] * 4


def make_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|pad|>", "<|bos|>", "<|endoftext|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|endoftext|>")
    fast.save_pretrained(str(folder))


def mtp_tensors(cfg: dict, seed: int) -> dict:
    """An MTP block named as Qwen3.5 checkpoints name it (one full-attention layer plus fc and
    norms); transformers ignores `mtp.*`."""
    g = np.random.default_rng(seed)
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    qd = cfg["num_attention_heads"] * cfg["head_dim"]
    kvd = cfg["num_key_value_heads"] * cfg["head_dim"]
    p = "mtp.layers.0."
    shapes = {
        f"{p}input_layernorm.weight": (h,), f"{p}post_attention_layernorm.weight": (h,),
        f"{p}self_attn.q_proj.weight": (2 * qd, h), f"{p}self_attn.k_proj.weight": (kvd, h),
        f"{p}self_attn.v_proj.weight": (kvd, h), f"{p}self_attn.o_proj.weight": (h, qd),
        f"{p}self_attn.q_norm.weight": (cfg["head_dim"],), f"{p}self_attn.k_norm.weight": (cfg["head_dim"],),
        f"{p}mlp.gate_proj.weight": (i, h), f"{p}mlp.up_proj.weight": (i, h), f"{p}mlp.down_proj.weight": (h, i),
        "mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,),
    }
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            out[name] = g.uniform(-0.3, 0.3, shape).astype(np.float32)
        else:
            out[name] = (g.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    return out


CONVERT = r"""
import sys
sys.path.insert(0, sys.argv[1] + "/gguf-py")
sys.path.insert(0, sys.argv[1])
import conversion.base as base
# The tiny tokenizer is not one of the converter's known pre-tokenizers (it hashes a sample
# encoding); name Qwen3.5's, as the real checkpoints get.
for cls in vars(base).values():
    if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
        cls.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
convert_hf_to_gguf.main()
"""


def read_tensors(path: Path) -> dict:
    """Every tensor of a GGUF file: name -> (type name, dequantized f32 in the GGUF numpy
    layout [.., rows, cols])."""
    r = GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        qt = T(int(t.tensor_type))
        shape = [int(x) for x in reversed(t.shape.tolist())]
        if qt == T.Q2_0:
            raw = np.asarray(t.data, dtype=np.uint8)
            v = mq.q2_0_dequant(raw, int(np.prod(shape[:-1])), shape[-1]).reshape(shape)
        else:
            v = np.asarray(quants.dequantize(np.asarray(t.data), qt), dtype=np.float32).reshape(shape)
        out[t.name] = (qt.name, v)
    return out


def write_imatrix(src: Path, dst: Path, seed: int) -> None:
    """Random positive mean squared activations for every 2-D weight of `src`."""
    g = np.random.default_rng(seed)
    w = GGUFWriter(str(dst), "imatrix")
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", ["random activations (tools/make_llamacpp_gguf_fixtures.py)"])
    w.add_uint32("imatrix.chunk_count", 16)
    w.add_uint32("imatrix.chunk_size", 64)
    for t in GGUFReader(str(src)).tensors:
        if len(t.shape) < 2 or not t.name.endswith(".weight"):
            continue
        cols = int(t.shape[0])
        count = 16.0
        w.add_tensor(f"{t.name}.in_sum2", (g.uniform(0.2, 2.0, cols) * count).astype(np.float32))
        w.add_tensor(f"{t.name}.counts", np.array([count], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def undo(hf: dict, gg: dict, cfg: dict, nmap) -> tuple[dict, dict]:
    """The HF tensors a converted GGUF encodes: (tensors, {hf name: stored type})."""
    ref, formats = {}, {}
    for name, orig in hf.items():
        if name.startswith("mtp."):
            continue
        gname = mq.gguf_name(name, nmap)
        if gname not in gg:
            raise SystemExit(f"the converter wrote no {gname} for {name}")
        ty, v = gg[gname]
        back = mq.to_gguf_layout(name, v, cfg, inverse=True)
        if back.shape != orig.shape:
            raise SystemExit(f"{gname}: {back.shape} does not undo to {name} {orig.shape}")
        ref[name] = np.ascontiguousarray(back)
        formats[name] = ty
    return ref, formats


def make(name: str, seed: int) -> None:
    changes, mtp, qargs = MODELS[name]
    cfg = {**BASE, **changes}
    vl = cfg.pop("vl_layout", False)
    if mtp:
        cfg["mtp_num_hidden_layers"] = mtp
    hf = mq.random_qwen3_5({k: v for k, v in cfg.items() if k != "mtp_num_hidden_layers"}, seed)
    if mtp:
        hf.update(mtp_tensors(cfg, seed + 1))
    folder = mq.fresh(OUT / name)
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        ck = tmp / "hf"
        ck.mkdir()
        saved, saved_cfg = dict(hf), cfg
        if vl:
            saved = {("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in hf.items()}
            # The converter's text model must leave the vision tower to --mmproj.
            saved["model.visual.patch_embed.proj.weight"] = np.ones((8, 24), np.float32)
            text = {k: v for k, v in cfg.items() if k not in ("architectures",)}
            saved_cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                         "tie_word_embeddings": cfg["tie_word_embeddings"], "text_config": text,
                         "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 8}}
        (ck / "config.json").write_text(json.dumps(saved_cfg, indent=1))
        save_file({k: np.ascontiguousarray(v) for k, v in saved.items()}, str(ck / "model.safetensors"), metadata={"format": "pt"})
        make_tokenizer(ck)
        f32 = tmp / "f32.gguf"
        # The converter's MTP support asserts an MTP block unless told there is none.
        no_mtp = [] if mtp else ["--no-mtp"]
        subprocess.run([sys.executable, "-c", CONVERT, str(LLAMA_CPP), "--outtype", "f32", *no_mtp, "--outfile", str(f32), str(ck)], check=True)

        nmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, cfg["num_hidden_layers"] + mtp)
        conv = read_tensors(f32)
        if mtp and not any(n.startswith(f"blk.{cfg['num_hidden_layers']}.nextn.") for n in conv):
            raise SystemExit("the converter wrote no MTP (nextn) tensors")
        if any("visual" in n or n.startswith("v.") for n in conv):
            raise SystemExit("the converter wrote vision tensors into the text GGUF")
        back, _ = undo(hf, conv, cfg, nmap)
        for k, v in back.items():
            if not np.allclose(v, hf[k], atol=1e-6, rtol=0):
                raise SystemExit(f"{k}: undoing the converter does not give the checkpoint back (max {np.abs(v - hf[k]).max()})")

        imatrix = tmp / "imatrix.gguf"
        write_imatrix(f32, imatrix, seed + 2)
        qpath = folder / "model.gguf"
        # Run where the imatrix is, so the file name llama-quantize records is not a temp path.
        subprocess.run([str(QUANTIZE), "--imatrix", imatrix.name, *qargs[:-1], str(f32), str(qpath.resolve()), qargs[-1]],
                       check=True, cwd=tmp)
        shutil.copy(ck / "tokenizer.json", folder / "tokenizer.json")

    ref, formats = undo(hf, read_tensors(qpath), cfg, nmap)
    kinds = sorted(set(formats.values()))
    # llama-quantize silently falls back (e.g. IQ3_S -> IQ4_NL) when a row is not whole blocks.
    unsupported = set(kinds) - {"F32", "F16", "BF16", "Q8_0", "Q2_0", "IQ3_S", "IQ3_XXS", "IQ2_XS"}
    if unsupported:
        raise SystemExit(f"{name}: llama-quantize wrote {sorted(unsupported)}; change the --tensor-type overrides")
    model = mq.load_model({k: v for k, v in cfg.items() if k != "mtp_num_hidden_layers"}, ref)
    desc = (f"qwen3_5_text ({'tied' if cfg['tie_word_embeddings'] else 'untied'} head"
            f"{', MTP block' if mtp else ''}{', saved as Qwen3_5ForConditionalGeneration' if vl else ''}) converted by llama.cpp's convert_hf_to_gguf.py and quantized by "
            f"llama-quantize: {'/'.join(kinds)}")
    mq.save_expected(folder, name, desc, cfg, mq.reference(model, cfg["vocab_size"]), formats)
    exp = json.loads((folder / "expected.json").read_text())
    exp["generated_by"]["command"] = "python tools/make_llamacpp_gguf_fixtures.py"
    exp["generated_by"]["llama_cpp"] = "vendored in llama-cpp-python 0.3.36 (convert_hf_to_gguf.py, llama-quantize)"
    exp["generated_by"]["llama_quantize_args"] = qargs
    exp["mtp_layers"] = mtp
    (folder / "expected.json").write_text(json.dumps(exp, indent=1) + "\n")
    print(name, kinds, f"{qpath.stat().st_size} bytes")


def make_qwen4exp_experts() -> None:
    """Flash-Next: the tiny qwen4_exp_text/fused checkpoint through the converter's qwen4exp
    model (conversion/qwen4exp.py) and llama-quantize; the engine takes only the routed experts
    (blk.N.ffn_{gate,up,down}_exps) from that GGUF, the rest from the safetensors beside it."""
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    name = "qwen4exp_experts"
    src = ROOT / "crates" / "engine" / "tests" / "fixtures" / "qwen4_exp_text" / "fused"
    cfg = json.loads((src / "config.json").read_text())
    base = load_file(str(src / "model.safetensors"))
    folder = mq.fresh(OUT / name)
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        ck = tmp / "hf"
        ck.mkdir()
        for f in ("config.json", "model.safetensors"):
            shutil.copy(src / f, ck / f)
        # A vocabulary below 256 entries has no room for byte-level BPE: one word per id.
        tok = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(cfg["vocab_size"])}, unk_token="<t0>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>").save_pretrained(str(ck))
        f32 = tmp / "f32.gguf"
        subprocess.run([sys.executable, "-c", CONVERT, str(LLAMA_CPP), "--outtype", "f32", "--outfile", str(f32), str(ck)], check=True)
        n_exp = cfg["num_experts"]
        projs = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}

        def experts(path: Path):
            gg = read_tensors(path)
            out, formats = {}, {}
            for n in range(cfg["num_hidden_layers"]):
                for proj, gname in projs.items():
                    ty, v = gg[f"blk.{n}.{gname}.weight"]
                    if v.shape[0] != n_exp:
                        raise SystemExit(f"blk.{n}.{gname}: shape {v.shape}, expected [{n_exp}, rows, cols]")
                    for e in range(n_exp):
                        k = f"model.layers.{n}.mlp.experts.{e}.{proj}.weight"
                        out[k] = np.ascontiguousarray(v[e])
                        formats[k] = ty
            return out, formats

        conv, _ = experts(f32)
        for k, v in conv.items():
            if not np.array_equal(v, base[k]):
                raise SystemExit(f"{k}: the converter's expert tensor is not the checkpoint's")
        qpath = folder / "experts.gguf"
        # Q8_0 where a row is whole 32-blocks (gate/up: 32 columns); down has 16 columns, so
        # llama-quantize keeps it in F16. Everything else (ignored by the engine) Q8_0/F16 too.
        qargs = ["--tensor-type", "ffn_gate_exps=q8_0", "--tensor-type", "ffn_up_exps=q8_0", "Q8_0"]
        subprocess.run([str(QUANTIZE), *qargs[:-1], str(f32), str(qpath), qargs[-1]], check=True)
    quant, formats = experts(qpath)
    kinds = sorted(set(formats.values()))
    if not set(kinds) <= {"F16", "Q8_0"} or "Q8_0" not in kinds:
        raise SystemExit(f"unexpected expert types {kinds}")
    ref = {**base, **quant}
    model = mq.load_model(cfg, ref)
    desc = ("qwen4_exp_text/fused: routed experts from experts.gguf, written by llama.cpp's convert_hf_to_gguf.py "
            f"(qwen4exp) and llama-quantize ({'/'.join(kinds)}); the rest from the fixture's safetensors")
    mq.save_expected(folder, name, desc, cfg, mq.reference(model, cfg["vocab_size"]), formats)
    exp = json.loads((folder / "expected.json").read_text())
    exp["generated_by"]["command"] = "python tools/make_llamacpp_gguf_fixtures.py make_qwen4exp_experts"
    exp["generated_by"]["llama_cpp"] = "vendored in llama-cpp-python 0.3.36 (convert_hf_to_gguf.py, llama-quantize)"
    exp["generated_by"]["llama_quantize_args"] = qargs
    exp["safetensors_from"] = "qwen4_exp_text/fused"
    (folder / "expected.json").write_text(json.dumps(exp, indent=1) + "\n")
    print(name, kinds, f"{qpath.stat().st_size} bytes")


def main() -> None:
    if not QUANTIZE.exists():
        raise SystemExit(f"{QUANTIZE} is missing: build llama-quantize in {LLAMA_CPP} (see the docstring)")
    OUT.mkdir(parents=True, exist_ok=True)
    only = sys.argv[1:]
    for i, name in enumerate(MODELS):
        if not only or name in only:
            make(name, 7100 + 10 * i)
    if not only or "make_qwen4exp_experts" in only:
        make_qwen4exp_experts()


if __name__ == "__main__":
    main()
