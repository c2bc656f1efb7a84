#!/usr/bin/env python3
"""Quantized versions of the tiny checkpoints, with transformers' logits on their dequantized
weights (the fixtures of crates/engine/tests/quant_models.rs).

    /work/venv-ref/bin/python tools/make_quant_model_fixtures.py   # CPU, about a minute

Writes crates/engine/tests/fixtures/quant_models/<name>/:
- `nvfp4_qwen3_5`: ModelOpt NVFP4 export of qwen3_5_text/gqa4x2_gdn2x4_rot25 (hf_quant_config.json
  and config.json quantization_config; `weight` U8, `weight_scale` F8_E4M3 per 16,
  `weight_scale_2` F32, `input_scale` F32, `k_scale`/`v_scale`); embedding, lm_head and the GDN of
  layer 0 are excluded and stored in BF16.
- `fp8_qwen3_5`: FP8 E4M3 export of qwen3_5_text/gqa4x1_gdn2x2_rot50_8layers: block scales
  (`weight_scale_inv`, weight_block_size [32, 16] so that the tiny matrices span several blocks)
  for the attention and GDN projections, row scales (`weight_scale`, [N] and [N, 1]) for the MLP.
- `nvfp4_qwen4_exp`: qwen4_exp_text/fused with its routed experts as per-expert NVFP4 tensors,
  the shared experts FP8 with row scales, everything else BF16.
- `gguf_qwen35_iq.gguf` (untied) and `gguf_qwen35_tied/model.gguf` (tied head, layer types no
  full_attention_interval can express): qwen35 GGUF files laid out as llama.cpp's
  convert_hf_to_gguf.py (Qwen3_5TextModel) writes them: its tensor names (from the gguf
  package's TensorNameMap), its metadata keys, and its transforms (norms stored as w + 1 except
  the GDN gated norm, A_log as -exp(A_log), dt_bias as ssm_dt.bias, conv1d squeezed, value
  heads reordered grouped -> tiled), plus an MTP block (nextn_predict_layers = 1) to ignore.
  The tensors are mixed Q8_0 / Q2_0 / IQ3_S / IQ3_XXS / IQ2_XS / F16 / BF16 / F32. Q8_0 comes
  from gguf.quants.quantize, Q2_0 from the spec (see make_quant_fixtures.py); the IQ tensors
  are random valid blocks (scaled to a sensible weight size) because quantizing to IQ types
  needs llama-quantize, which is not built here. The files are written by this script with the
  gguf package's GGUFWriter, not by convert_hf_to_gguf.py itself (whose current version needs
  the matching gguf-py of its repository).
- `gguf_experts_qwen4_exp`: qwen4_exp_text/fused with every tensor but the routed experts in
  BF16 safetensors and the experts in `experts.gguf` (blk.N.ffn_{gate,up,down}_exps: Q8_0,
  F16, BF16): "experts from GGUF, the rest from safetensors".

In every case the reference model's weights are what the quantized files encode: each GGUF
tensor dequantized by the gguf package (Q2_0 by the spec), the converter's transforms undone in
numpy; NVFP4 / FP8 dequantized from their bit layouts. transformers 5.17 (eager attention) runs
that model; `expected.json` holds the prompts, the logits files (`logits_<i>.f32`, little-endian
[len, vocab]) and the greedy continuations.
"""
from __future__ import annotations

import json
import math
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file, save_file

import gguf
from gguf import GGUFWriter, quants
from gguf.constants import GGMLQuantizationType as T

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "crates" / "engine" / "tests" / "fixtures"
OUT = FIX / "quant_models"
NEW_TOKENS = 8
MIN_MARGIN = 2e-2

rng = np.random.default_rng(20261203)

# ---------------------------------------------------------------------------------------------
# Bit layouts
# ---------------------------------------------------------------------------------------------
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def e4m3_decode(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.int32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = b & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    mag = np.where((exp == 15) & (man == 7), np.nan, mag)
    return (sign * mag).astype(np.float32)


def nvfp4_quantize(w: np.ndarray):
    """ModelOpt-style NVFP4: returns (codes [N, K/2] u8, scales [N, K/16] e4m3 bytes,
    scale_2 f32, dequantized f32)."""
    n, k = w.shape
    amax = np.float32(np.abs(w).max())
    s2 = np.float32(amax / (6.0 * 448.0))
    g = w.reshape(n, k // 16, 16)
    gmax = np.abs(g).max(-1)
    sbytes = e4m3_encode(gmax / 6.0 / s2)
    sdec = e4m3_decode(sbytes)
    denom = sdec * s2
    denom[denom == 0] = 1.0
    q = g / denom[..., None]
    codes = np.abs(q[..., None] - E2M1[None, None, None, :8]).argmin(-1).astype(np.uint8)
    codes = np.where(q < 0, codes | 8, codes).astype(np.uint8).reshape(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    deq = ((E2M1[codes].reshape(n, k // 16, 16) * sdec[..., None]) * s2).astype(np.float32).reshape(n, k)
    return packed, sbytes.reshape(n, k // 16), s2, deq


def fp8_block_quantize(w: np.ndarray, bn: int, bk: int):
    n, k = w.shape
    sn, sk = -(-n // bn), -(-k // bk)
    scales = np.zeros((sn, sk), np.float32)
    for i in range(sn):
        for j in range(sk):
            scales[i, j] = max(np.abs(w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]).max(), 1e-8) / 448.0
    full = np.repeat(np.repeat(scales, bn, 0), bk, 1)[:n, :k]
    q = e4m3_encode(w / full)
    return q, scales, (e4m3_decode(q) * full).astype(np.float32)


def fp8_row_quantize(w: np.ndarray):
    s = (np.maximum(np.abs(w).max(1), 1e-8) / 448.0).astype(np.float32)
    q = e4m3_encode(w / s[:, None])
    return q, s, (e4m3_decode(q) * s[:, None]).astype(np.float32)


def bf16_round(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16).float().numpy()


def bf16_bytes(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16).view(torch.uint16).numpy().view(np.uint8).reshape(*x.shape, 2)


# ---------------------------------------------------------------------------------------------
# GGUF block types
# ---------------------------------------------------------------------------------------------
Q2_0_ID = 42


def q2_0_quantize(w: np.ndarray) -> np.ndarray:
    """Q2_0 (spec): per 64 weights an fp16 d, codes c in 0..3, value (c - 1) * d."""
    rows, k = w.shape
    b = w.reshape(-1, 64)
    d = (np.abs(b).max(1) / 2.0).astype(np.float16)
    df = d.astype(np.float32)
    df[df == 0] = 1.0
    codes = np.clip(np.rint(b / df[:, None]) + 1, 0, 3).astype(np.uint8)
    c = codes.reshape(-1, 16, 4)
    qs = (c[:, :, 0] | (c[:, :, 1] << 2) | (c[:, :, 2] << 4) | (c[:, :, 3] << 6)).astype(np.uint8)
    raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), qs], axis=1)
    return raw.reshape(rows, k // 64 * 18)


def q2_0_dequant(raw: np.ndarray, rows: int, k: int) -> np.ndarray:
    b = raw.reshape(-1, 18)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    codes = (b[:, 2:18, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :]) & 3
    codes = codes.reshape(-1, 64).astype(np.int32)
    return ((codes - 1).astype(np.float32) * d).reshape(rows, k)


def random_iq(qtype, rows: int, k: int, target_std: float) -> np.ndarray:
    """Random valid IQ blocks whose dequantized weights have about `target_std`."""
    block, size = quants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * k // block, size), dtype=np.uint8)
    raw[:, 0:2] = np.array([1.0], np.float16).view(np.uint8)
    unit = quants.dequantize(raw.reshape(rows, -1), qtype)
    d = (target_std / max(float(unit.std()), 1e-6)) * rng.uniform(0.7, 1.3, raw.shape[0])
    raw[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def encode(w: np.ndarray, qtype):
    """Stores a 2-D (or 3-D) f32 array as `qtype`; returns (bytes or array for the writer,
    raw_dtype, the dequantized values the file encodes)."""
    shape = w.shape
    k = shape[-1]
    rows = int(np.prod(shape[:-1]))
    flat = w.reshape(rows, k)
    if qtype == T.F32:
        return w.astype(np.float32), None, w.astype(np.float32)
    if qtype == T.F16:
        h = w.astype(np.float16)
        return h, None, h.astype(np.float32)
    if qtype == T.BF16:
        return bf16_bytes(w).reshape(*shape[:-1], 2 * k), T.BF16, bf16_round(w)
    if qtype == "Q2_0":
        raw = q2_0_quantize(flat)
        return raw.reshape(*shape[:-1], -1), "Q2_0", q2_0_dequant(raw, rows, k).reshape(shape)
    if qtype == T.Q8_0:
        raw = quants.quantize(flat, T.Q8_0)
        return raw.reshape(*shape[:-1], -1), T.Q8_0, quants.dequantize(raw, T.Q8_0).reshape(shape)
    raw = random_iq(qtype, rows, k, float(flat.std()))
    return raw.reshape(*shape[:-1], -1), qtype, quants.dequantize(raw, qtype).reshape(shape)


def patch_q2_0(path: Path, names: list[str]) -> None:
    """GGUFWriter knows no type 42: those tensors were written as I8 byte rows; rewrite their
    tensor infos to Q2_0 (same bytes; dims in weights)."""
    reader = gguf.GGUFReader(str(path))
    data = bytearray(path.read_bytes())
    for t in reader.tensors:
        if t.name not in names:
            continue
        f = t.field
        # parts: name len, name, n_dims, dims..., type, offset
        pos = f.offset
        name_len = int(f.parts[0][0])
        pos += 8 + name_len
        n_dims = int(f.parts[2][0])
        pos += 4
        row_bytes = struct.unpack_from("<Q", data, pos)[0]
        struct.pack_into("<Q", data, pos, row_bytes // 18 * 64)
        pos += 8 * n_dims
        struct.pack_into("<I", data, pos, Q2_0_ID)
    path.write_bytes(bytes(data))


def write_gguf(path: Path, arch: str, meta, tensors) -> None:
    """`tensors`: list of (name, array, raw_dtype)."""
    w = GGUFWriter(str(path), arch)
    meta(w)
    q2 = []
    for name, arr, raw in tensors:
        if raw == "Q2_0":
            w.add_tensor(name, arr.view(np.int8), raw_dtype=T.I8)
            q2.append(name)
        elif raw is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if q2:
        patch_q2_0(path, q2)


# ---------------------------------------------------------------------------------------------
# The llama.cpp converter's qwen35 layout (Qwen3NextModel + _LinearAttentionVReorderBase)
# ---------------------------------------------------------------------------------------------
def tile(x: np.ndarray, axis: int, nk: int, r: int, hd: int, inverse=False) -> np.ndarray:
    """grouped [k0v0, k0v1, .., k1v0, ..] -> tiled [k0v0, k1v0, .., k0v1, ..] along `axis`
    (or back)."""
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    if inverse:
        y = x.reshape(r, nk, hd, *rest).swapaxes(0, 1)
    else:
        y = x.reshape(nk, r, hd, *rest).swapaxes(0, 1)
    return np.moveaxis(np.ascontiguousarray(y).reshape(x.shape), 0, axis)


def to_gguf_layout(name: str, t: np.ndarray, cfg: dict, inverse=False) -> np.ndarray:
    """The converter's transform of one HF tensor (or, with `inverse`, its undoing)."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    r = nv // nk
    t = t.astype(np.float32)

    def reorder(x):
        if nk == nv or "linear_attn." not in name:
            return x
        if ".in_proj_qkv." in name:
            q = 2 * kd * nk
            return np.concatenate([x[:q], tile(x[q:], 0, nk, r, vd, inverse)], 0)
        if ".in_proj_z." in name:
            return tile(x, 0, nk, r, vd, inverse)
        if ".in_proj_b." in name or ".in_proj_a." in name or name.endswith(".A_log") or name.endswith(".dt_bias"):
            return tile(x, 0, nk, r, 1, inverse)
        if ".conv1d." in name:
            q = 2 * kd * nk
            return np.concatenate([x[:q], tile(x[q:], 0, nk, r, vd, inverse)], 0)
        if ".out_proj." in name:
            return tile(x, 1, nk, r, vd, inverse)
        return x

    if not inverse:
        t = reorder(t.squeeze(1) if ".conv1d." in name else t)
        if name.endswith(".A_log"):
            t = -np.exp(t)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + np.float32(1)
        return t.astype(np.float32)
    if name.endswith(".A_log"):
        t = np.log(-t)
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t - np.float32(1)
    t = reorder(t)
    if ".conv1d." in name:
        t = t[:, None, :]
    return t.astype(np.float32)


def gguf_name(hf: str, nmap) -> str:
    if hf.endswith(".dt_bias"):
        hf = hf[: -len(".dt_bias")] + ".dt_proj.bias"
    for suffix in (".weight", ".bias", ""):
        if suffix and not hf.endswith(suffix):
            continue
        base = hf[: len(hf) - len(suffix)] if suffix else hf
        g = nmap.get_name(base)
        if g is not None:
            return g + suffix
    raise SystemExit(f"no GGUF name for {hf}")


def qwen35_metadata(cfg: dict, mtp: int):
    def meta(w: GGUFWriter):
        w.add_block_count(cfg["num_hidden_layers"] + mtp)
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_embedding_length(cfg["hidden_size"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
        w.add_rope_dimension_count(int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"]))
        w.add_rope_dimension_sections(list(cfg["rope_parameters"]["mrope_section"]) + [0])
        if mtp:
            w.add_nextn_predict_layers(mtp)
        w.add_eos_token_id(cfg["eos_token_id"])
        w.add_bos_token_id(cfg["bos_token_id"])
    return meta


def qwen35_gguf(path: Path, cfg: dict, hf: dict, choose, mtp_types) -> dict:
    """Writes `hf` (f32 HF tensors) as a qwen35 GGUF; `choose(hf_name, gguf_array)` picks the
    type. Returns the reference HF tensors (what the file encodes, transforms undone)."""
    layers = cfg["num_hidden_layers"]
    nmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, layers + 1)
    out, ref = [], {}
    for name in sorted(hf):
        g = to_gguf_layout(name, hf[name], cfg)
        qtype = choose(name, g)
        arr, raw, deq = encode(g, qtype)
        out.append((gguf_name(name, nmap), arr, raw))
        ref[name] = to_gguf_layout(name, deq, cfg, inverse=True)
    # An MTP block after the last layer (a full-attention layer plus the nextn tensors), as the
    # converter writes it; the loader must ignore it.
    h, b = cfg["hidden_size"], layers
    qd = cfg["num_attention_heads"] * cfg["head_dim"]
    kvd = cfg["num_key_value_heads"] * cfg["head_dim"]
    mtp = {
        f"blk.{b}.attn_norm.weight": (h,), f"blk.{b}.attn_q.weight": (2 * qd, h),
        f"blk.{b}.attn_k.weight": (kvd, h), f"blk.{b}.attn_v.weight": (kvd, h),
        f"blk.{b}.attn_output.weight": (h, qd), f"blk.{b}.ffn_gate.weight": (cfg["intermediate_size"], h),
        f"blk.{b}.nextn.eh_proj.weight": (h, 2 * h), f"blk.{b}.nextn.enorm.weight": (h,),
        f"blk.{b}.nextn.hnorm.weight": (h,), f"blk.{b}.nextn.shared_head_norm.weight": (h,),
    }
    for name, shape in mtp.items():
        x = rng.standard_normal(shape).astype(np.float32)
        arr, raw, _ = encode(x, mtp_types if len(shape) == 2 else T.F32)
        out.append((name, arr, raw))
    write_gguf(path, "qwen35", qwen35_metadata(cfg, 1), out)
    return ref


# ---------------------------------------------------------------------------------------------
# The reference: transformers on the dequantized weights
# ---------------------------------------------------------------------------------------------
def load_model(cfg: dict, tensors: dict):
    tmp = Path(tempfile.mkdtemp())
    try:
        (tmp / "config.json").write_text(json.dumps(cfg))
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if cfg["model_type"] == "qwen4_exp_text":
            from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForCausalLM as M
        else:
            from transformers import Qwen3_5ForCausalLM as M
        model = M.from_pretrained(str(tmp), attn_implementation="eager", dtype=torch.float32).eval()
        # Every tensor must have been loaded (nothing left at its random init).
        sd = model.state_dict()
        for k, v in tensors.items():
            if k in sd and v.dtype == np.float32:
                if not np.array_equal(sd[k].numpy(), v):
                    raise SystemExit(f"{k} was not loaded as written")
        return model
    finally:
        shutil.rmtree(tmp)


@torch.no_grad()
def reference(model, vocab: int, lengths=(5, 13)) -> list[dict]:
    from transformers import GenerationConfig

    for attempt in range(40):
        g = torch.Generator().manual_seed(1000 + attempt)
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
        results, ok = [], True
        for ids in prompts:
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
            seq, margin = list(ids), float("inf")
            for _ in range(NEW_TOKENS):
                last = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].float()
                top = torch.topk(last, 2)
                margin = min(margin, float(top.values[0] - top.values[1]))
                seq.append(int(top.indices[0]))
            gc = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=0,
                                  eos_token_id=None, pad_token_id=0, bos_token_id=None)
            gen = model.generate(input_ids=torch.tensor([ids]), generation_config=gc, use_cache=True)[0, len(ids):].tolist()
            if gen != seq[len(ids):]:
                ok = False
            if margin < MIN_MARGIN:
                ok = False
            results.append(dict(ids=ids, logits=logits.numpy(), greedy=seq[len(ids):], margin=margin))
        if ok:
            return results
    raise SystemExit("no prompts with a clear greedy path")


def save_expected(folder: Path, name: str, description: str, cfg: dict, results, formats: dict, logits_dir: Path | None = None) -> None:
    logits_dir = logits_dir or folder
    prompts = []
    for i, r in enumerate(results):
        f = f"logits_{i}.f32"
        r["logits"].astype("<f4").tofile(logits_dir / f)
        prompts.append({
            "token_ids": r["ids"],
            "logits_file": f,
            "logits_shape": list(r["logits"].shape),
            "greedy_new_tokens": r["greedy"],
            "greedy_min_margin": round(r["margin"], 6),
        })
    (logits_dir / "expected.json").write_text(json.dumps({
        "fixture": name,
        "description": description,
        "architecture": cfg["model_type"],
        "vocab_size": cfg["vocab_size"],
        "logit_tolerance": 1e-3,
        "formats": formats,
        "prompts": prompts,
        "generated_by": {
            "command": "python tools/make_quant_model_fixtures.py",
            "transformers": transformers.__version__,
            "torch": torch.__version__.split("+")[0],
            "gguf": getattr(gguf, "__version__", "0.19.0"),
            "attn_implementation": "eager",
        },
    }, indent=1) + "\n")


def read_base(sub: str):
    d = FIX / sub
    cfg = json.loads((d / "config.json").read_text())
    return cfg, load_file(str(d / "model.safetensors"))


def fresh(folder: Path) -> Path:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def is_linear(name: str, t: np.ndarray) -> bool:
    return t.ndim == 2 and name.endswith(".weight") and "embed" not in name and name != "lm_head.weight"


# ---------------------------------------------------------------------------------------------
def make_nvfp4_qwen3_5() -> None:
    cfg, base = read_base("qwen3_5_text/gqa4x2_gdn2x4_rot25")
    folder = fresh(OUT / "nvfp4_qwen3_5")
    exclude = ["lm_head", "model.embed_tokens", "model.layers.0.linear_attn*"]
    qc = {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16, "exclude_modules": exclude}
    stored, ref, formats = {}, {}, {}
    for name, t in sorted(base.items()):
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        excluded = any(module.startswith(p[:-1]) if p.endswith("*") else module == p for p in exclude)
        if is_linear(name, t) and not excluded and t.shape[1] % 16 == 0:
            codes, scales, s2, deq = nvfp4_quantize(t)
            stored[name] = codes
            stored[f"{module}.weight_scale"] = scales
            stored[f"{module}.weight_scale_2"] = np.array(s2, np.float32).reshape(())
            stored[f"{module}.input_scale"] = np.array(rng.uniform(0.01, 0.1), np.float32).reshape(())
            ref[name] = deq
            formats[name] = "nvfp4"
        else:
            stored[name] = t
            ref[name] = bf16_round(t)
            formats[name] = "bf16"
    for i, lt in enumerate(cfg["layer_types"]):
        if lt == "full_attention":
            stored[f"model.layers.{i}.self_attn.k_proj.k_scale"] = np.array(1.0, np.float32).reshape(())
            stored[f"model.layers.{i}.self_attn.v_proj.v_scale"] = np.array(1.0, np.float32).reshape(())
    write_st_bf16(folder / "model.safetensors", stored, formats)
    qcfg = dict(cfg)
    qcfg["quantization_config"] = {"quant_method": "modelopt", **qc}
    (folder / "config.json").write_text(json.dumps(qcfg, indent=1))
    (folder / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.37.0"}, "quantization": qc}, indent=1))
    model = load_model(cfg, ref)
    save_expected(folder, "nvfp4_qwen3_5", "ModelOpt NVFP4 of qwen3_5_text/gqa4x2_gdn2x4_rot25; embedding, lm_head and layer 0's GDN excluded (BF16)", cfg, reference(model, cfg["vocab_size"]), formats)


def write_st_bf16(path: Path, stored: dict, formats: dict) -> None:
    """Writes through torch (numpy has no bfloat16 / float8): tensors whose format is "bf16"
    become BF16, FP8 weights and NVFP4 `weight_scale` F8_E4M3, the rest keep their dtype."""
    from safetensors.torch import save_file as save_torch
    out = {}
    for k, v in stored.items():
        t = torch.from_numpy(np.ascontiguousarray(v))
        base = k[: -len("_scale")] if k.endswith(".weight_scale") else k
        if formats.get(k) == "bf16":
            t = t.to(torch.bfloat16)
        elif formats.get(k, "").startswith("fp8") or (k.endswith(".weight_scale") and formats.get(base) == "nvfp4"):
            t = t.view(torch.float8_e4m3fn)
        out[k] = t
    save_torch(out, str(path), metadata={"format": "pt"})


def make_fp8_qwen3_5() -> None:
    cfg, base = read_base("qwen3_5_text/gqa4x1_gdn2x2_rot50_8layers")
    folder = fresh(OUT / "fp8_qwen3_5")
    bn, bk = 32, 16
    stored, ref, formats = {}, {}, {}
    row_as_column = True
    for name, t in sorted(base.items()):
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        if is_linear(name, t) and ".mlp." in name:
            q, s, deq = fp8_row_quantize(t)
            stored[name] = q
            stored[f"{module}.weight_scale"] = s[:, None] if row_as_column else s
            row_as_column = not row_as_column
            formats[name] = "fp8_row"
        elif is_linear(name, t):
            q, s, deq = fp8_block_quantize(t, bn, bk)
            stored[name] = q
            stored[f"{module}.weight_scale_inv"] = s
            formats[name] = "fp8_block"
        else:
            stored[name] = t
            deq = bf16_round(t)
            formats[name] = "bf16"
        ref[name] = deq
    write_st_bf16(folder / "model.safetensors", stored, formats)
    qcfg = dict(cfg)
    qcfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [bn, bk]}
    (folder / "config.json").write_text(json.dumps(qcfg, indent=1))
    model = load_model(cfg, ref)
    save_expected(folder, "fp8_qwen3_5", f"FP8 E4M3 of qwen3_5_text/gqa4x1_gdn2x2_rot50_8layers: {bn}x{bk} block scales (weight_scale_inv) for attention/GDN, row scales for the MLP", cfg, reference(model, cfg["vocab_size"]), formats)


def make_nvfp4_qwen4_exp() -> None:
    cfg, base = read_base("qwen4_exp_text/fused")
    folder = fresh(OUT / "nvfp4_qwen4_exp")
    stored, ref, formats = {}, {}, {}
    for name, t in sorted(base.items()):
        if ".mlp.experts." in name and t.ndim == 2:
            # transformers saves the routed experts per expert (experts.{e}.gate_proj.weight, ...)
            m = name[: -len(".weight")]
            codes, scales, s2, deq = nvfp4_quantize(t)
            stored[name] = codes
            stored[f"{m}.weight_scale"] = scales
            stored[f"{m}.weight_scale_2"] = np.array(s2, np.float32).reshape(())
            stored[f"{m}.input_scale"] = np.array(0.05, np.float32).reshape(())
            formats[name] = "nvfp4"
            ref[name] = deq
        elif ".shared_expert." in name and t.ndim == 2:
            q, s, deq = fp8_row_quantize(t)
            stored[name] = q
            stored[name[: -len(".weight")] + ".weight_scale"] = s
            formats[name] = "fp8_row"
            ref[name] = deq
        elif t.dtype == np.float32:
            stored[name] = t
            formats[name] = "bf16"
            ref[name] = bf16_round(t)
        else:
            stored[name] = t
            ref[name] = t
    write_st_bf16(folder / "model.safetensors", stored, formats)
    qcfg = dict(cfg)
    qc = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": ["lm_head", "model.embed_tokens"]}
    qcfg["quantization_config"] = {"quant_method": "modelopt", **qc}
    (folder / "config.json").write_text(json.dumps(qcfg, indent=1))
    (folder / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.37.0"}, "quantization": qc}, indent=1))
    model = load_model(cfg, ref)
    save_expected(folder, "nvfp4_qwen4_exp", "qwen4_exp_text/fused with per-expert NVFP4 routed experts, FP8 row-scaled shared experts, the rest BF16", cfg, reference(model, cfg["vocab_size"]), {k: v for k, v in formats.items() if v != "bf16"})


# ---------------------------------------------------------------------------------------------
def random_qwen3_5(cfg: dict, seed: int) -> dict:
    sys.path.insert(0, str(ROOT / "tools"))
    from make_fixtures import init_value  # the fixture generator's value rules
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg)).eval()
    out = {}
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        out[name] = init_value(name, p.shape, gen).numpy().astype(np.float32)
    if cfg["tie_word_embeddings"]:
        out.pop("lm_head.weight", None)
    return out


def make_gguf_iq() -> None:
    cfg = dict(
        model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"],
        vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention", "linear_attention"], full_attention_interval=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_act="silu", attention_bias=False,
    )
    hf = random_qwen3_5(cfg, 4242)
    iq = [T.IQ3_S, T.IQ3_XXS, T.IQ2_XS]
    counter = {"i": 0}
    formats = {}

    def choose(name, g):
        if g.ndim == 1 or ".conv1d." in name:
            t = T.F32
        elif "embed_tokens" in name:
            t = T.Q8_0
        elif name == "lm_head.weight":
            t = T.IQ3_S
        elif g.shape[-1] % 256 == 0 and (".mlp." in name or "in_proj_qkv" in name or "q_proj" in name):
            t = iq[counter["i"] % 3]
            counter["i"] += 1
        elif "in_proj_b" in name:
            t = T.F16
        elif "in_proj_a" in name:
            t = T.BF16
        elif g.shape[-1] % 64 == 0 and ("o_proj" in name or "out_proj" in name or "in_proj_z" in name):
            t = "Q2_0"
        else:
            t = T.Q8_0
        formats[name] = t if isinstance(t, str) else t.name
        return t

    folder = OUT
    path = folder / "gguf_qwen35_iq.gguf"
    ref = qwen35_gguf(path, cfg, hf, choose, "Q2_0")
    model = load_model(cfg, ref)
    sub = fresh(OUT / "gguf_qwen35_iq.expected")
    save_expected(sub, "gguf_qwen35_iq", "qwen35 GGUF (untied head, MTP block), mixed IQ3_S/IQ3_XXS/IQ2_XS/Q2_0/Q8_0/F16/BF16/F32; the model is gguf_qwen35_iq.gguf beside this folder", cfg, reference(model, cfg["vocab_size"]), formats, logits_dir=sub)


def make_gguf_tied() -> None:
    base_cfg, base = read_base("qwen3_5_text/mha2x2_tied_layer_types")
    cfg = dict(base_cfg)
    folder = fresh(OUT / "gguf_qwen35_tied")
    formats = {}

    def choose(name, g):
        if g.ndim == 1 or ".conv1d." in name:
            t = T.F32
        elif "in_proj_b" in name or "in_proj_a" in name:
            t = T.F16
        elif ".mlp.down_proj" in name and g.shape[-1] % 64 == 0:
            t = "Q2_0"
        elif g.shape[-1] % 32 == 0:
            t = T.Q8_0
        else:
            t = T.BF16
        formats[name] = t if isinstance(t, str) else t.name
        return t

    ref = qwen35_gguf(folder / "model.gguf", cfg, dict(base), choose, T.Q8_0)
    assert "lm_head.weight" not in ref
    model = load_model(cfg, ref)
    save_expected(folder, "gguf_qwen35_tied", "qwen35 GGUF of qwen3_5_text/mha2x2_tied_layer_types (tied head, irregular layer types, MTP block), Q8_0/Q2_0/F16/F32", cfg, reference(model, cfg["vocab_size"]), formats)


def make_gguf_experts() -> None:
    cfg, base = read_base("qwen4_exp_text/fused")
    folder = fresh(OUT / "gguf_experts_qwen4_exp")
    inter = cfg["moe_intermediate_size"]
    stored, ref, formats, tensors = {}, {}, {}, []
    n_exp = cfg["num_experts"]
    kinds = {"gate_proj": ("ffn_gate_exps", T.Q8_0), "up_proj": ("ffn_up_exps", T.F16), "down_proj": ("ffn_down_exps", T.BF16)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}.mlp.experts."
        for proj, (gname, qtype) in kinds.items():
            stack = np.stack([base[f"{p}{e}.{proj}.weight"] for e in range(n_exp)])
            arr, raw, deq = encode(stack, qtype)
            tensors.append((f"blk.{n}.{gname}.weight", arr, raw))
            for e in range(n_exp):
                ref[f"{p}{e}.{proj}.weight"] = np.ascontiguousarray(deq[e])
                formats[f"{p}{e}.{proj}.weight"] = qtype.name
    for name, t in sorted(base.items()):
        if ".mlp.experts." in name:
            continue
        if t.dtype == np.float32:
            stored[name] = t
            formats[name] = "bf16"
            ref[name] = bf16_round(t)
        else:
            stored[name] = t
            ref[name] = t

    def meta(w):
        w.add_block_count(cfg["num_hidden_layers"])
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_feed_forward_length(inter)

    write_gguf(folder / "experts.gguf", "qwen4_exp", meta, tensors)
    write_st_bf16(folder / "model.safetensors", stored, formats)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    model = load_model(cfg, ref)
    save_expected(folder, "gguf_experts_qwen4_exp", "qwen4_exp_text/fused: routed experts from experts.gguf (Q8_0/F16/BF16), the rest from BF16 safetensors", cfg, reference(model, cfg["vocab_size"]), {k: v for k, v in formats.items() if v != "bf16"})


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    steps = [make_nvfp4_qwen3_5, make_fp8_qwen3_5, make_nvfp4_qwen4_exp, make_gguf_iq, make_gguf_tied, make_gguf_experts]
    only = sys.argv[1:]
    for step in steps:
        if only and step.__name__ not in only:
            continue
        print(step.__name__)
        step()


if __name__ == "__main__":
    main()
