#!/usr/bin/env bash
# Builds what the GPU box runs (it has no Rust): the release capy-flash and every CUDA test
# executable, stripped, into .gpu/ (keep .gpu/ in .git/info/exclude) so that a device call can
# carry that one folder. The tests travel as .gpu/tests.tar.xz (common.sh unpacks it on the box):
# with the tree and .gpu-base they would pass the call's 64 MiB carry limit uncompressed. Usage: tools/gpu_box/build.sh   (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p capy-flash
rm -rf .gpu/tests .gpu/tests.tar.xz
mkdir -p .gpu/tests
cp "${CARGO_TARGET_DIR:-target}/release/capy-flash" .gpu/
strip .gpu/capy-flash
for t in cuda_ops cuda_graphs cuda_bench cuda_flash_next_ops cuda_hybrid cuda_nvrtc_compile \
         cuda_qwen3_5_text_fixtures cuda_qwen4_exp_text_fixtures tensor_parallel_cuda; do
  exe=$(cargo test --release -p capy-engine --test "$t" --no-run --message-format=json 2>/dev/null |
    python3 -c 'import sys, json
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("executable") and m.get("target", {}).get("kind") == ["test"]: print(m["executable"])' | tail -1)
  [ -n "$exe" ] || { echo "no test executable for $t" >&2; exit 1; }
  cp "$exe" ".gpu/tests/$t"
  strip ".gpu/tests/$t"
done
# The test executables find their fixtures through the path they were built at.
pwd > .gpu/built_at
# Bench records name the commit their binary was built from (the box's copy of the tree does
# not carry this checkout's git state); "+dirty" when the tree had uncommitted changes.
echo "$(git rev-parse HEAD)$(git diff --quiet HEAD -- crates kernels || echo +dirty)" > .gpu/commit
tar -C .gpu -cJf .gpu/tests.tar.xz tests
rm -rf .gpu/tests
ls -la .gpu
