"""What `k3x export` is asked for and what it resolves to, apart from the stages that do it
(exporter/pipeline.py) so that both writers — one program (pipeline.write_program) and one program per rank
(exporter/ranks.write_ranks) — take the same job without importing each other. Torch-free at import: the CLI
imports it for its option types.

- `ExportOptions`: the request (targets, source, dtype, kernels, expert format and activations, cache, parallel
  plan), checked on construction (ConfigError naming the flag); `TARGET_STAGES`: what each `--target` runs.
- `ExportJob`: the options resolved once (architecture, `ModelOptions`, plan, dtype, checkpoint hash).
- `timed_step` / `Timed`: one step of the export, timed and reported to the caller's progress callback.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:
    import torch

    from ..model.config import K3Config
    from ..model.options import ModelOptions
    from ..model.parallel import ParallelPlan

Progress = Callable[[str, "float | None"], None]  # (stage, None) when it starts, (stage, seconds) when done


class Target(str, Enum):
    PT2 = "pt2"
    ONNX = "onnx"
    AOTI = "aoti"
    ALL = "all"


class DType(str, Enum):
    AUTO = "auto"  # the checkpoint's dtype, or the preset's default (exporter/presets.model_dtype)
    FP32 = "fp32"
    BF16 = "bf16"


class KernelChoice(str, Enum):  # the values of plan.kernels.Kernels, importable without torch
    REFERENCE = "reference"
    TRITON = "triton"


class ExpertFormat(str, Enum):  # model.options.BuildOptions.expert_format
    DENSE = "dense"
    MXFP4 = "mxfp4"


class WeightSource(str, Enum):  # where a checkpoint export's pt2 / ONNX weights live
    COPY = "copy"  # written into the artifacts
    REFERENCE = "reference"  # read from the checkpoint at load (manifest `weight_source`: checkpoint/reference.py)


class Activations(str, Enum):  # model.options.BuildOptions.activations (expert-GEMM inputs)
    BF16 = "bf16"
    MXFP8 = "mxfp8"


class Trunk(str, Enum):  # model.options.BuildOptions.trunk (model/trunk.py)
    DENSE = "dense"  # the projections in the export's dtype
    BF16 = "bf16"  # bf16 weights, fp32 activations (CPU)
    INT8 = "int8"  # 8-bit block-quantised weights, fp32 activations (CPU)


class TraceMode(str, Enum):  # exporter/trace.TRACE_MODES
    STAMPED = "stamped"
    PER_LAYER = "per-layer"


def config_error(message: str) -> Exception:
    from ..model.config import ConfigError

    return ConfigError(message)


@dataclass(frozen=True)
class ExportOptions:
    targets: tuple[Target, ...]  # several targets share the one trace and the one manifest
    out_dir: Path
    preset: str | None = None  # exactly one of preset / checkpoint
    checkpoint: Path | None = None
    weights: bool = True  # False: trace on the meta device, nothing allocated
    dtype: DType = DType.AUTO
    seed: int = 0  # random init of a preset with weights
    kernels: KernelChoice = KernelChoice.REFERENCE  # k3 custom-op implementation in the traced program
    expert_format: ExpertFormat | None = None  # routed experts: None = as the checkpoint stores them (presets: dense)
    max_context: int | None = None  # static MLA latent cache of this many positions (model/state.py); None = growing
    tp: int = 1  # the parallel plan (model/parallel.ParallelPlan): tp x ep rank programs; 1 x 1 = one program
    ep: int = 1
    serving: bool = False  # trace the serving step (packed sequences, state pools: exporter/serving.py)
    block_size: int = 16  # serving: positions per MLA latent block (fixed in the program)
    activations: Activations = Activations.BF16  # expert-GEMM inputs: as computed, or MXFP8 (MXFP4 experts)
    trace_mode: TraceMode = TraceMode.STAMPED  # each distinct layer traced once, or every layer (exporter/stamp.py)
    weight_source: WeightSource = WeightSource.COPY
    onnx_functions: bool = True  # ONNX: one local function per layer kind (exporter/onnx_functions.py)
    trunk: Trunk = Trunk.DENSE  # the dense projections' weights: the dtype's, bf16 or int8 (fp32 activations)

    def __post_init__(self) -> None:
        if (self.preset is None) == (self.checkpoint is None):
            raise config_error("export: give exactly one of --preset or --checkpoint")
        if self.trace_mode not in {m.value for m in TraceMode}:
            raise config_error(f"--trace-mode: {self.trace_mode!r} is not one of stamped, per-layer")
        if not self.targets:
            raise config_error("export: give at least one --target")
        if self.serving and (self.max_context is not None or self.block_size < 1):
            raise config_error("--serving: no --max-context (the pools replace it), "
                               f"--block-size >= 1 (got {self.block_size})")
        if "aoti" in self.stages() and not self.weights:
            raise config_error("--no-weights: target 'aoti' embeds the weights in the package; drop --no-weights "
                                "or export --target pt2 --target onnx")
        if self.tp * self.ep > 1 and not set(self.stages()) <= {"pt2", "onnx"}:
            raise config_error(f"--tp/--ep: rank programs are written for --target pt2 and onnx only "
                                f"(got {list(self.stages())})")
        if self.tp * self.ep > 1 and self.max_context is not None:
            raise config_error("--max-context: the static latent cache is not available for rank programs "
                               "(--tp/--ep > 1)")
        if Trunk(self.trunk) != Trunk.DENSE:
            self._check_trunk()
        if self.references_checkpoint:
            self._check_reference()

    @property
    def references_checkpoint(self) -> bool:
        return WeightSource(self.weight_source) == WeightSource.REFERENCE

    def _check_trunk(self) -> None:
        flag = f"--trunk {Trunk(self.trunk).value}"
        if DType(self.dtype) == DType.BF16:
            raise config_error(f"{flag}: the activations are fp32 (the projections' weights are "
                               f"{Trunk(self.trunk).value}); drop --dtype bf16")
        if self.tp * self.ep > 1:
            raise config_error(f"{flag}: not for rank programs (--tp/--ep); the CPU trunks are one program")
        if self.references_checkpoint:
            raise config_error(f"{flag}: the trunk's weights are written at export (bf16 or quantised), not read "
                               "from the checkpoint at load; use --weights copy")

    def _check_reference(self) -> None:
        if self.checkpoint is None or not self.weights:
            raise config_error("--weights reference: needs --checkpoint (the weights are read from it at load) "
                               "and not --no-weights")
        if self.tp * self.ep > 1:
            raise config_error("--weights reference: not for rank programs (--tp/--ep): a rank's weights are slices "
                               "of the checkpoint's tensors (the row-parallel o_proj / down_proj slices are not "
                               "contiguous byte ranges) and the rank runners do not slice a referenced checkpoint "
                               "at load; use --weights copy")
        if not set(self.stages()) <= {"pt2", "onnx"}:
            raise config_error("--weights reference: the weights stay outside the pt2 and ONNX only: --target pt2 "
                               f"and/or onnx (got {list(self.stages())}; aoti compiles them in)")

    def plan(self) -> ParallelPlan:
        from ..model.parallel import ParallelPlan

        return ParallelPlan(self.tp, self.ep)

    def stages(self) -> tuple[str, ...]:
        """The stage names of every target, in order, each once."""
        return tuple(dict.fromkeys(s for t in self.targets for s in TARGET_STAGES[Target(t)]))


# what each --target runs, in order, after the one trace, in order, after the one trace
TARGET_STAGES: dict[Target, tuple[str, ...]] = {
    Target.PT2: ("pt2",),
    Target.ONNX: ("onnx",),
    Target.AOTI: ("aoti",),
    Target.ALL: ("pt2", "onnx", "aoti"),
}


@contextlib.contextmanager
def timed_step(name: str, progress: Progress, timings: dict[str, float]) -> Iterator[None]:
    progress(name, None)
    t = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - t
    progress(name, timings[name])


Timed = Callable[[str], "contextlib.AbstractContextManager[None]"]


@dataclass(frozen=True)
class ExportJob:
    """What an export writes, resolved once from `ExportOptions` before anything is built."""
    options: ExportOptions
    cfg: K3Config  # the architecture
    model: ModelOptions  # kernels, expert format, cache: recorded in the manifest's `options` entry
    plan: ParallelPlan
    dtype: torch.dtype
    checkpoint_hash: str | None
    weight_source: dict | None  # --weights reference: the manifest's checkpoint reference (checkpoint/reference.py)
    stream: bool  # pt2 / ONNX from a checkpoint: traced on meta, weights streamed into each artifact
    dtype_note: str = ""  # the output line saying which dtype was chosen and why (exporter/presets.dtype_line)
