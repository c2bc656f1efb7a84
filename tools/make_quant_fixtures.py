#!/usr/bin/env python3
"""Writes the quantisation test fixtures (and the IQ lattice tables) from independent references.

    /work/venv-ref/bin/python tools/make_quant_fixtures.py            # fixtures
    /work/venv-ref/bin/python tools/make_quant_fixtures.py --tables   # crates/engine/src/quant/iq_tables.rs

References:
- GGUF block types (Q8_0, IQ3_XXS, IQ3_S, IQ2_XS, F16, BF16, F32): the `gguf` package's numpy
  dequantisation (`gguf.quants.dequantize`) of random valid blocks.
- Q2_0 (ggml type 42, newer than gguf 0.19): numpy written here from the spec: an fp16 scale d,
  16 bytes of 2-bit codes, element 4*b + j in bits 2j..2j+1 of byte b, value (code - 1) * d.
- NVFP4 (ModelOpt) and FP8 E4M3: numpy written here from the spec (E2M1 / E4M3 bit layouts),
  not from any engine code.
- `small.gguf`: written by `gguf.GGUFWriter` with metadata of every value type and tensors of
  several types; `small.gguf.json` holds what a reader must find.

Outputs (crates/engine/tests/fixtures/quant/):
- `<type>.bin` raw blocks, `<type>.f32` their dequantised values (little-endian f32);
- `nvfp4.bin` = weight codes [N, K/2] u8, then scales [N, K/16] E4M3 bytes, then
  weight_scale_2 (f32); `nvfp4.f32` the dequantised [N, K];
- `fp8_block.bin` = weight [N, K] E4M3 bytes then block scales [ceil(N/128), ceil(K/128)] f32;
  `fp8_row.bin` = weight then row scales [N] f32; `.f32` the dequantised values;
- `small.gguf`, `small.gguf.json`.
"""
import json
import os
import sys

import numpy as np

from gguf import GGUFWriter, quants
from gguf.constants import GGMLQuantizationType as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "crates", "engine", "tests", "fixtures", "quant")
TABLES = os.path.join(ROOT, "crates", "engine", "src", "quant", "iq_tables.rs")

rng = np.random.default_rng(20261202)


def random_f16(n, lo=1e-3, hi=2e-2):
    """Random finite fp16 scales with random signs, as little-endian bytes [n, 2]."""
    v = rng.uniform(lo, hi, n) * rng.choice([-1.0, 1.0], n)
    return v.astype(np.float16).view(np.uint8).reshape(n, 2)


def random_blocks(qtype, n_blocks):
    """Random valid blocks: a finite fp16 super-scale first, any bits for the rest."""
    block, size = quants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    raw[:, 0:2] = random_f16(n_blocks)
    return raw


def q2_0_dequant(raw):
    """Q2_0 reference from the spec (see module doc)."""
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    qs = raw[:, 2:18]
    codes = (qs[:, :, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :]) & 3
    codes = codes.reshape(raw.shape[0], 64).astype(np.int32)  # element 4*b + j
    return ((codes - 1).astype(np.float32) * d).astype(np.float32)


def e4m3_decode(bytes_u8):
    """FP8 E4M3 (fn: no infinities, S.1111.111 is NaN) from its bit layout."""
    b = bytes_u8.astype(np.int32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = b & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    mag = np.where((exp == 15) & (man == 7), np.nan, mag)
    return (sign * mag).astype(np.float32)


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def e2m1_decode(codes):
    """E2M1 from its bit layout: sign bit 3, exponent bits 1..2 (bias 1), mantissa bit 0."""
    c = codes.astype(np.int32)
    sign = np.where(c & 8, -1.0, 1.0)
    exp = (c >> 1) & 3
    man = c & 1
    mag = np.where(exp == 0, man * 0.5, (1.0 + man / 2.0) * 2.0 ** (exp - 1.0))
    out = (sign * mag).astype(np.float32)
    assert np.array_equal(out, E2M1[c]), "E2M1 bit decode disagrees with the value list"
    return out


def random_e4m3_scales(shape, max_exp=9):
    """Positive finite E4M3 scales (as ModelOpt writes), exponent field 1..max_exp."""
    exp = rng.integers(1, max_exp + 1, shape)
    man = rng.integers(0, 8, shape)
    return ((exp << 3) | man).astype(np.uint8)


def write(name, data):
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(np.ascontiguousarray(data).tobytes())


def ggml_fixtures():
    counts = {T.Q8_0: 64, T.IQ3_XXS: 16, T.IQ3_S: 16, T.IQ2_XS: 16}
    for qtype, n in counts.items():
        raw = random_blocks(qtype, n)
        deq = quants.dequantize(raw, qtype).astype(np.float32)
        write(f"{qtype.name.lower()}.bin", raw)
        write(f"{qtype.name.lower()}.f32", deq)
    # Q2_0: 18-byte blocks of 64.
    raw = rng.integers(0, 256, (48, 18), dtype=np.uint8)
    raw[:, 0:2] = random_f16(48)
    write("q2_0.bin", raw)
    write("q2_0.f32", q2_0_dequant(raw))
    # Plain float types: random values including awkward ones (subnormals, signed zero).
    vals = rng.standard_normal(1024).astype(np.float32)
    vals[:4] = [0.0, -0.0, 1e-40, -3e-39]
    write("f32.bin", vals)
    write("f32.f32", quants.dequantize(vals.view(np.uint8), T.F32))
    h = (rng.standard_normal(1024) * 4).astype(np.float16)
    h[:3] = [np.float16(6e-8), np.float16(-0.0), np.float16(65504)]
    write("f16.bin", h)
    write("f16.f32", quants.dequantize(h.view(np.uint8), T.F16).astype(np.float32))
    bf_bits = (vals.view(np.uint32) >> 16).astype(np.uint16)
    write("bf16.bin", bf_bits)
    write("bf16.f32", quants.dequantize(bf_bits.view(np.uint8), T.BF16).astype(np.float32))


def nvfp4_fixture(n=16, k=128):
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    # ModelOpt packs element 2i in the low nibble of byte i, 2i+1 in the high nibble.
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scales = random_e4m3_scales((n, k // 16))
    scale_2 = np.array([0.0123457], dtype=np.float32)
    w = e2m1_decode(codes) * np.repeat(e4m3_decode(scales), 16, axis=1) * scale_2[0]
    write("nvfp4.bin", np.concatenate([packed.ravel(), scales.ravel(), scale_2.view(np.uint8)]))
    write("nvfp4.f32", w.astype(np.float32))


def fp8_fixtures(n=200, k=300):
    w = rng.integers(0, 256, (n, k), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0x3C  # no NaN weights
    bn, bk = -(-n // 128), -(-k // 128)
    block_scales = rng.uniform(0.5, 2.0, (bn, bk)).astype(np.float32)
    full = np.repeat(np.repeat(block_scales, 128, axis=0), 128, axis=1)[:n, :k]
    write("fp8_block.bin", np.concatenate([w.ravel(), block_scales.view(np.uint8).ravel()]))
    write("fp8_block.f32", (e4m3_decode(w) * full).astype(np.float32))
    row_scales = rng.uniform(0.5, 2.0, n).astype(np.float32)
    write("fp8_row.bin", np.concatenate([w.ravel(), row_scales.view(np.uint8)]))
    write("fp8_row.f32", (e4m3_decode(w) * row_scales[:, None]).astype(np.float32))


def gguf_fixture():
    path = os.path.join(OUT, "small.gguf")
    writer = GGUFWriter(path, arch="qwen35")
    writer.add_uint8("test.u8", 200)
    writer.add_int8("test.i8", -100)
    writer.add_uint16("test.u16", 60000)
    writer.add_int16("test.i16", -30000)
    writer.add_uint32("test.u32", 4000000000)
    writer.add_int32("test.i32", -2000000000)
    writer.add_float32("test.f32", 1.5)
    writer.add_uint64("test.u64", 1 << 40)
    writer.add_int64("test.i64", -(1 << 40))
    writer.add_float64("test.f64", 2.25)
    writer.add_bool("test.bool", True)
    writer.add_string("test.string", "capybara ✓")
    writer.add_array("test.array_i32", [1, -2, 3])
    writer.add_array("test.array_str", ["a", "bc", ""])
    writer.add_uint32("qwen35.block_count", 2)
    tensors = {}
    x = rng.standard_normal((3, 64)).astype(np.float32)
    writer.add_tensor("t.f32", x)
    tensors["t.f32"] = ("F32", [64, 3], x)
    h = rng.standard_normal((2, 32)).astype(np.float16)
    writer.add_tensor("t.f16", h)
    tensors["t.f16"] = ("F16", [32, 2], h.astype(np.float32))
    for qtype, rows, cols in [(T.Q8_0, 4, 64), (T.IQ3_S, 2, 512), (T.IQ3_XXS, 3, 256), (T.IQ2_XS, 2, 256)]:
        block, size = quants.GGML_QUANT_SIZES[qtype]
        raw = random_blocks(qtype, rows * cols // block).reshape(rows, cols // block * size)
        name = f"t.{qtype.name.lower()}"
        writer.add_tensor(name, raw, raw_dtype=qtype)
        tensors[name] = (qtype.name, [cols, rows], quants.dequantize(raw, qtype))
    bf = (rng.standard_normal((2, 16)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    writer.add_tensor("t.bf16", bf.view(np.uint8), raw_dtype=T.BF16)
    tensors["t.bf16"] = ("BF16", [16, 2], quants.dequantize(bf.view(np.uint8), T.BF16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expect = {
        "version": 3,
        "alignment": 32,
        "metadata": {
            "general.architecture": "qwen35",
            "test.u8": 200, "test.i8": -100, "test.u16": 60000, "test.i16": -30000,
            "test.u32": 4000000000, "test.i32": -2000000000, "test.f32": 1.5,
            "test.u64": 1 << 40, "test.i64": -(1 << 40), "test.f64": 2.25, "test.bool": True,
            "test.string": "capybara ✓", "test.array_i32": [1, -2, 3], "test.array_str": ["a", "bc", ""],
            "qwen35.block_count": 2,
        },
        "tensors": {
            name: {"type": ty, "shape": shape, "values": [float(v) for v in np.asarray(vals, dtype=np.float32).ravel()]}
            for name, (ty, shape, vals) in tensors.items()
        },
    }
    with open(path + ".json", "w") as f:
        json.dump(expect, f)


def tables():
    def grid(cls):
        cls.init_grid()
        return cls.grid.reshape(cls.grid_shape).astype(np.uint8)

    out = [
        "//! Lattice and sign tables of the ggml IQ block types (part of the format).",
        "//!",
        "//! Generated by `tools/make_quant_fixtures.py --tables` from the `gguf` package's grids",
        "//! (`gguf/quants.py`); do not edit by hand. Each grid entry packs its byte values",
        "//! little-endian: value `j` of an entry is byte `j` of the integer.",
        "",
    ]

    def emit(doc, name, g, ty):
        n, w = g.shape
        vals = [sum(int(b) << (8 * j) for j, b in enumerate(row)) for row in g]
        per_line = 8 if w == 4 else 4
        out.append(f"/// {doc}")
        out.append(f"pub static {name}: [{ty}; {n}] = [")
        for i in range(0, n, per_line):
            out.append("    " + ", ".join(f"0x{v:0{2 * w}x}" for v in vals[i:i + per_line]) + ",")
        out.append("];")
        out.append("")

    emit("IQ2_XS: 512 entries of 8 magnitudes from {8, 25, 43}.", "IQ2XS_GRID", grid(quants.IQ2_XS), "u64")
    emit("IQ3_XXS: 256 entries of 4 magnitudes from {4, 12, …, 62}.", "IQ3XXS_GRID", grid(quants.IQ3_XXS), "u32")
    emit("IQ3_S: 512 entries of 4 odd magnitudes 1..15.", "IQ3S_GRID", grid(quants.IQ3_S), "u32")
    ks = np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8)
    out.append("/// Sign patterns: entry `i` (7 bits) gives 8 sign bits, the 8th chosen for even parity.")
    out.append("pub static KSIGNS_IQ2XS: [u8; 128] = [")
    for i in range(0, 128, 16):
        out.append("    " + ", ".join(f"0x{v:02x}" for v in ks[i:i + 16]) + ",")
    out.append("];")
    with open(TABLES, "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    if "--tables" in sys.argv:
        tables()
    else:
        os.makedirs(OUT, exist_ok=True)
        ggml_fixtures()
        nvfp4_fixture()
        fp8_fixtures()
        gguf_fixture()
