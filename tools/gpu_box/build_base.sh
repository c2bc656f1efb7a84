#!/usr/bin/env bash
# Builds the release capy-flash of an earlier commit (the baseline of an A/B pass) into
# .gpu-base/capy-flash.xz (compressed: .gpu and .gpu-base travel together under the device
# call's 64 MiB carry limit). Usage: tools/gpu_box/build_base.sh COMMIT   (from the repo root;
# keep .gpu-base/ in .git/info/exclude). Its own target folder, so the current build stays.
set -euo pipefail
cd "$(dirname "$0")/../.."
base=${1:?usage: tools/gpu_box/build_base.sh COMMIT}
root=$(pwd)
wt=$(mktemp -d)/base
git worktree add -f --detach "$wt" "$base" >/dev/null
trap 'git -C "$root" worktree remove --force "$wt"' EXIT
( cd "$wt" && CARGO_TARGET_DIR="${BASE_TARGET_DIR:-$root/target/base}" cargo build --release -p capy-flash )
mkdir -p .gpu-base
cp "${BASE_TARGET_DIR:-$root/target/base}/release/capy-flash" .gpu-base/capy-flash
strip .gpu-base/capy-flash
xz -T0 -6 -f .gpu-base/capy-flash
git rev-parse "$base" > .gpu-base/commit
ls -la .gpu-base
