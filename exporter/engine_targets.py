"""Which GPUs a `build-engine` target serves, and which targets a runtime can build: refused before any work.

Notable choices:
- TensorRT 11 ("trt") builds for the GPU it runs on (an H100 / H200 engine is built on one); TensorRT-RTX
  ("trt-rtx", builds on a CPU) targets only the compute capabilities in `TRT_RTX_SMS`, which has no sm_90: its
  engines run with TensorRT-RTX on RTX-class GPUs of that SM, never on an H100 / H200 and never with TensorRT 11.
  `TRT_RTX_SMS` is the installed library's `ComputeCapability` list, written out so the check needs no import
  (tests/exporter/test_engine_targets.py compares the two).
- `check_target` runs while the options are parsed (exporter/engine.EngineOptions), before the folder is read or
  a TensorRT library imported; `serves` is the success line's description of what the engine runs on.
"""

from __future__ import annotations

RUNTIMES = {  # runtime -> (import names, pip packages)
    "trt": (("tensorrt",), "tensorrt-cu13 (TensorRT 11; the libs come from NVIDIA's package index)"),
    "trt-rtx": (("tensorrt_rtx", "tensorrt_rtx_bindings"),
                "the trt-rtx extra: pip install -e '.[trt-rtx]' (k3x build-engine finds its libraries itself)"),
}
DEFAULT_SM = {"trt": 90, "trt-rtx": 89}
TRT_RTX_SMS = {  # TensorRT-RTX 1.7's ComputeCapability members -> the GPUs of that SM
    75: "Turing: RTX 20xx, T4", 80: "Ampere: A100, A30", 86: "Ampere: RTX 30xx, A10, A40",
    89: "Ada: RTX 40xx, L4, L40S", 120: "Blackwell: RTX 50xx, RTX PRO 6000", 121: "Blackwell: GB10",
}
GPUS = TRT_RTX_SMS | {90: "Hopper: H100, H200", 100: "Blackwell: B200, GB200", 103: "Blackwell Ultra: B300, GB300"}
RUNTIME_HELP = ("auto (trt when TensorRT 11 and a GPU are here, else trt-rtx) | trt (TensorRT 11: builds for the GPU "
                "it runs on, e.g. sm_90 H100 / H200) | trt-rtx (TensorRT-RTX: builds on a CPU for RTX-class GPUs, "
                f"sm {', '.join(map(str, TRT_RTX_SMS))}; its engines do not run on H100 / H200 nor with TensorRT 11).")


def gpus(sm: int) -> str:
    return GPUS.get(sm, "no GPU k3x knows")


def check_target(runtime: str, sm: int) -> None:
    """ValueError naming `--sm` when `runtime` cannot build for `sm`."""
    if runtime == "trt-rtx" and sm not in TRT_RTX_SMS:
        raise ValueError(f"--sm {sm}: TensorRT-RTX cannot build for sm_{sm} ({gpus(sm)}); it targets "
                         f"{', '.join(f'sm_{s}' for s in TRT_RTX_SMS)}. For a GPU of sm_{sm} build with --runtime trt "
                         "(TensorRT 11) on that GPU")
    if sm <= 0:
        raise ValueError(f"--sm {sm}: not a compute capability (e.g. 89 for sm_89, 90 for sm_90)")


def serves(runtime: str, sm: int, version: str) -> str:
    """What the engine runs on, for the success line."""
    if runtime == "trt-rtx":
        return (f"serves sm_{sm} GPUs ({gpus(sm)}) with TensorRT-RTX {version} only: not H100 / H200, not TensorRT 11 "
                "(build those with --runtime trt on the GPU)")
    return f"serves sm_{sm} GPUs ({gpus(sm)}) with TensorRT {version}"
