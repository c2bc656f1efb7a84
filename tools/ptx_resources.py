#!/usr/bin/env python3
"""Registers, spills and shared memory of every kernel in kernels/*.cu for an architecture,
without a GPU: NVRTC (the nvidia-cuda-nvrtc wheel) compiles each file as the engine does
(kernels/common.cuh prepended, C++17) to PTX, and ptxas (the nvidia-cuda-nvcc wheel) reports
its resource use. Usage: tools/ptx_resources.py [sm_90] [name-regex]
(set CAPY_NVRTC_LIB to libnvrtc.so and put ptxas on PATH or in PTXAS)."""
import ctypes, os, re, subprocess, sys, tempfile, glob

arch = sys.argv[1] if len(sys.argv) > 1 else "sm_90"
pattern = re.compile(sys.argv[2]) if len(sys.argv) > 2 else None
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
nvrtc = ctypes.CDLL(os.environ["CAPY_NVRTC_LIB"])
ptxas = os.environ.get("PTXAS", "ptxas")
common = open(os.path.join(root, "kernels/common.cuh")).read()

def ptx_of(name, source):
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None) == 0
    opts = [f"--gpu-architecture=compute_{arch[3:]}".encode(), b"--std=c++17"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    if rc != 0:
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        sys.exit(f"{name}: NVRTC failed:\n{log.value.decode()}")
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode()

def stand_in_tables():
    """The quantized-weight tables that backend/cuda/kernels.rs `quant_tables` generates, with
    the same names, types and sizes but made-up values: what a kernel's registers and spills
    depend on (its loads from them are all by computed index, so no value is folded)."""
    tables = [("u32", "QT_E4M3", 256), ("u32", "QT_E2M1", 16), ("u32", "QT_IQ3S", 512),
              ("u32", "QT_IQ3XXS", 256), ("u64", "QT_IQ2XS", 512), ("unsigned char", "QT_KSIGNS", 128)]
    out = ""
    for ty, name, n in tables:
        mask = 0xFF if ty == "unsigned char" else 0xFFFFFFFF
        values = ",".join(hex((i * 0x9E3779B1 + 7) & mask) for i in range(n))
        out += f"__device__ const {ty} {name}[{n}] = {{{values}}};\n"
    return out

for path in sorted(glob.glob(os.path.join(root, "kernels/*.cu"))):
    name = os.path.basename(path)
    if name == "moe_quant.cu":
        continue  # compiled with quant_matvec.cu, as the engine does
    body = open(path).read()
    if name == "quant_matvec.cu":
        body = stand_in_tables() + body + "\n" + open(os.path.join(root, "kernels/moe_quant.cu")).read()
    ptx = ptx_of(name, common + "\n" + body)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([ptxas, f"-arch={arch}", "-v", f.name, "-o", os.devnull],
                         capture_output=True, text=True)
    func = None
    for line in out.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            func = m.group(1)
        m = re.search(r"Used (\d+) registers", line)
        if m and func and (pattern is None or pattern.search(func)):
            print(f"{name:18} {func:40} {line.split('info    : ')[-1].strip()}")
        if "spill" in line and func and (pattern is None or pattern.search(func)):
            print(f"{'':18} {func:40} {line.split('info    : ')[-1].strip()}")
