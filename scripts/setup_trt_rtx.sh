#!/usr/bin/env bash
# Install TensorRT-RTX 1.7.1 (CPU-capable engine builder) into a venv and create the unversioned-library
# symlink its ONNX parser dlopens for plugin nodes (docs/model.md §8). Prints the LD_LIBRARY_PATH to export; it must
# be set before Python starts (setting it inside the process does not work).
#   usage: scripts/setup_trt_rtx.sh [VENV_DIR] [WHEEL_DIR]   (defaults: .venv, pip's index)
#   then:  export LD_LIBRARY_PATH="$(scripts/setup_trt_rtx.sh --print-only):$LD_LIBRARY_PATH"
set -euo pipefail
print_only=0
if [[ "${1:-}" == "--print-only" ]]; then print_only=1; shift; fi
venv="${1:-.venv}"
wheels="${2:-}"
py="$venv/bin/python"
pkgs=(tensorrt-rtx-cu13-bindings==1.7.1.116 tensorrt-rtx-cu13-libs==1.7.1.116)
if [[ $print_only == 0 ]]; then
  if [[ -n "$wheels" ]]; then
    "$py" -m pip install --quiet --no-index --find-links "$wheels" "${pkgs[@]}" >&2
  else
    "$py" -m pip install --quiet "${pkgs[@]}" >&2
  fi
fi
libs="$("$py" -c 'import os, tensorrt_rtx_libs; print(os.path.dirname(tensorrt_rtx_libs.__file__))')"
link_dir="$(cd "$venv" && pwd)/trt-rtx-lib"
mkdir -p "$link_dir"
ln -sf "$libs/libtensorrt_rtx.so.1" "$link_dir/libtensorrt_rtx.so"
ln -sf "$libs/libtensorrt_onnxparser_rtx.so.1" "$link_dir/libtensorrt_onnxparser_rtx.so"
echo "$link_dir"
