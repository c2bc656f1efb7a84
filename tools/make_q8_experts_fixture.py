"""Rewrites the routed experts of the `gguf_experts_qwen4_exp` fixture with gate and up as
Q8_0 (down keeps its BF16: its rows of 16 are not whole 32-weight blocks), so a test can check
that quantized experts stay quantized on the CPU (no f32 copy) next to float ones, and multiply
exactly like their dequantized values.

    python tools/make_q8_experts_fixture.py   # needs `pip install gguf` (numpy); no torch

Writes crates/engine/tests/fixtures/quant_models/gguf_q8_experts_qwen4_exp/ (config.json and
model.safetensors copied, experts.gguf rewritten). Deterministic: Q8_0 quantization of the
source's dequantized values.
"""
import shutil
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

ROOT = Path(__file__).resolve().parent.parent / "crates/engine/tests/fixtures/quant_models"
SRC, DST = ROOT / "gguf_experts_qwen4_exp", ROOT / "gguf_q8_experts_qwen4_exp"


def main() -> None:
    DST.mkdir(exist_ok=True)
    for f in ["config.json", "model.safetensors"]:
        shutil.copyfile(SRC / f, DST / f)
    r = GGUFReader(SRC / "experts.gguf")
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    w = GGUFWriter(DST / "experts.gguf", arch)
    for key in ["block_count", "expert_count", "expert_feed_forward_length"]:
        f = r.fields[f"{arch}.{key}"]
        w.add_uint32(f"{arch}.{key}", int(f.parts[f.data[0]][0]))
    for t in r.tensors:
        # numpy shape: reversed GGUF dims ([experts, rows, cols]).
        shape = [int(d) for d in reversed(t.shape)]
        if "ffn_down" in t.name:
            w.add_tensor(t.name, np.asarray(t.data), raw_shape=shape[:-1] + [t.data.shape[-1]],
                         raw_dtype=t.tensor_type)
            continue
        values = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        q = quantize(values, GGMLQuantizationType.Q8_0)
        w.add_tensor(t.name, q, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
