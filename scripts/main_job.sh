#!/usr/bin/env bash
# README main job on k3-mini: random checkpoint -> one trace, exported as pt2 + ONNX
# -> greedy generation from a text prompt with ONNX Runtime carrying state (text streamed) -> parity table of pt2 and ORT vs eager
# (prefill + 8 decode steps, every output). Exits non-zero if any step fails.
#   usage: scripts/main_job.sh [WORK_DIR] [PROVIDER]     (PROVIDER: auto | cpu | cuda)
set -euo pipefail
WORK=${1:-k3x-main-job}
PROVIDER=${2:-auto}
rm -rf "$WORK"
k3x init-checkpoint --preset k3-mini --out "$WORK/ckpt"
k3x export --checkpoint "$WORK/ckpt" --target pt2 --target onnx --out "$WORK/export"
k3x run "$WORK/export" --backend ort --provider "$PROVIDER" --prompt "Hello! How are" --max-new-tokens 16
k3x verify "$WORK/export" --backends pt2,ort --provider "$PROVIDER" --steps 8 --json "$WORK/parity.json"
