#!/usr/bin/env bash
# README main job on k3-mini: random checkpoint -> one trace, exported as pt2 + ONNX
# -> greedy generation from a text prompt with ONNX Runtime carrying state (text streamed) -> parity table of pt2 and ORT vs eager
# (prefill + 8 decode steps, every output). Exits non-zero if any step fails.
#   usage: scripts/main_job.sh [WORK_DIR] [PROVIDER]     (PROVIDER: auto | cpu | cuda)
# WORK_DIR must be missing, empty, or a folder an earlier run of this script created (it holds the marker
# file .k3x-main-job); only then are the files this script writes there (ckpt/, export/, parity.json)
# replaced. Nothing else is ever deleted.
set -euo pipefail
WORK=${1:-k3x-main-job}
PROVIDER=${2:-auto}
MARKER=.k3x-main-job
if [[ -e "$WORK" && ! -d "$WORK" ]]; then
  echo "error: $WORK exists and is not a folder; choose another WORK_DIR" >&2; exit 2
fi
if [[ -d "$WORK" && -n "$(ls -A "$WORK")" && ! -f "$WORK/$MARKER" ]]; then
  echo "error: $WORK is not empty and was not created by scripts/main_job.sh; choose another WORK_DIR" >&2
  exit 2
fi
mkdir -p "$WORK"
touch "$WORK/$MARKER"
rm -rf -- "$WORK/ckpt" "$WORK/parity.json"   # ours (marker checked above); the export is replaced whole
k3x init-checkpoint --preset k3-mini --out "$WORK/ckpt"
k3x export --checkpoint "$WORK/ckpt" --target pt2 --target onnx --out "$WORK/export"
k3x run "$WORK/export" --backend ort --provider "$PROVIDER" --prompt "Hello! How are" --max-new-tokens 16
k3x verify "$WORK/export" --backends pt2,ort --provider "$PROVIDER" --steps 8 --json "$WORK/parity.json"
