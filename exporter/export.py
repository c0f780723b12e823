"""`k3x export` as one library call: source -> config check -> model -> trace -> manifest -> target stages.

    result = export(ExportOptions(targets=(Target.PT2, Target.ONNX), out_dir=Path("out"), preset="k3", weights=False))

Notable choices:
- The config is checked against what the ops support before anything is built or traced (each op family
  states its limits once, in custom_ops/<family>/op.py `check_config`); with the TensorRT ONNX flavor or
  `kernels=triton`, the Triton kernel limits too. A failure raises `ConfigError` naming the field.
- `kernels` (reference | triton) is the k3 custom-op implementation baked into the traced program; it is
  not the runner (`k3x run --backend`).
- `weights=False` builds on the meta device: any size traces on an ordinary CPU machine.
- From a checkpoint, pt2 and ONNX never hold the model: it is traced on meta and each stage streams the
  checkpoint's tensors into its artifact (`StageContext.weight_stream`); aoti (AOTInductor compiles real
  weights) loads the model as before.
- Whole exports (exporter/staging.py): everything is written into a sibling temporary folder
  (`StageContext.work_dir`) that replaces `out_dir` only once every stage succeeded; `out_dir` must be
  missing, empty or an earlier k3x export, and is locked against concurrent exports.
- Every target consumes the one traced `ExportedProgram`. A stage is a plain function
  `stage(ep, ctx) -> str` (a line for the user) that writes its files through
  `artifacts.write_artifact`, so each artifact is renamed into place and listed in the manifest.
- Adding a target (e.g. ONNX) = one `Target` member, one `STAGES` entry, one `TARGET_STAGES` entry:
      class Target: ONNX = "onnx"; ALL = "all"
      STAGES["onnx"] = stage_onnx
      TARGET_STAGES[Target.ONNX] = ("onnx",);  TARGET_STAGES[Target.ALL] = ("pt2", "onnx", "aoti")
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:  # this module is imported by the CLI: torch only inside functions
    import torch
    from torch.export import ExportedProgram

    from ..model.config import K3Config


class Target(str, Enum):
    PT2 = "pt2"
    ONNX = "onnx"
    AOTI = "aoti"
    ALL = "all"


class DType(str, Enum):
    FP32 = "fp32"
    BF16 = "bf16"


class KernelChoice(str, Enum):  # the values of custom_ops.kernels.Kernels, importable without torch
    REFERENCE = "reference"
    TRITON = "triton"


class ExpertFormat(str, Enum):  # model.config.K3Config.expert_format
    DENSE = "dense"
    MXFP4 = "mxfp4"


def _config_error(message: str) -> Exception:
    from ..model.config import ConfigError

    return ConfigError(message)


@dataclass(frozen=True)
class ExportOptions:
    targets: tuple[Target, ...]  # several targets share the one trace and the one manifest
    out_dir: Path
    preset: str | None = None  # exactly one of preset / checkpoint
    checkpoint: Path | None = None
    weights: bool = True  # False: trace on the meta device, nothing allocated
    dtype: DType = DType.FP32
    seed: int = 0  # random init of a preset with weights
    kernels: KernelChoice = KernelChoice.REFERENCE  # k3 custom-op implementation in the traced program
    expert_format: ExpertFormat | None = None  # routed experts: None = as the checkpoint stores them (presets: dense)
    max_context: int | None = None  # static MLA latent cache of this many positions (model/state.py); None = growing

    def __post_init__(self) -> None:
        if (self.preset is None) == (self.checkpoint is None):
            raise _config_error("export: give exactly one of --preset or --checkpoint")
        if not self.targets:
            raise _config_error("export: give at least one --target")
        if "aoti" in self.stages() and not self.weights:
            raise _config_error("--no-weights: target 'aoti' embeds the weights in the package; drop --no-weights "
                                "or export --target pt2 --target onnx")

    def stages(self) -> tuple[str, ...]:
        """The stage names of every target, in order, each once."""
        return tuple(dict.fromkeys(s for t in self.targets for s in TARGET_STAGES[Target(t)]))


@dataclass(frozen=True)
class StageContext:
    cfg: K3Config
    options: ExportOptions
    work_dir: Path  # where stages write (renamed to out_dir when the export is complete)
    weight_stream: Callable | None = None  # the checkpoint's tensors one by one (a meta-traced program)

    @property
    def out_dir(self) -> Path:
        return self.options.out_dir


@dataclass
class ExportResult:
    out_dir: Path
    manifest: dict
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds
    notes: list[str] = field(default_factory=list)  # one line per target stage, for the user


Stage = Callable[["ExportedProgram", StageContext], str]
Progress = Callable[[str, "float | None"], None]  # (stage, None) when it starts, (stage, seconds) when done


# --- target stages -------------------------------------------------------------------------------

def stage_pt2(ep: ExportedProgram, ctx: StageContext) -> str:
    from . import artifacts
    from .trace import save_pt2

    name, digests = "model.pt2", {}
    with artifacts.write_artifact(ctx.work_dir, "pt2", {"weights": ctx.options.weights,
                                                       "load": "k3x.exporter.trace.load_pt2"}, digests=digests) as tmp:
        if ctx.weight_stream is not None:  # traced on meta: weights written tensor by tensor from the checkpoint
            from .pt2_weights import save_streamed_pt2

            digests[name] = save_streamed_pt2(ep, tmp / name, ctx.weight_stream())
        else:
            save_pt2(ep, tmp / name)
    if ctx.options.weights:
        return f"pt2: {ctx.out_dir / name}"
    return (f"pt2: {ctx.out_dir / name} (weightless: names/shapes/dtypes only; "
            "attach weights with k3x.exporter.trace.with_weights)")


def stage_aoti(ep: ExportedProgram, ctx: StageContext) -> str:
    from . import artifacts
    from .aoti import PACKAGE, REQUIRES, compile_aoti

    with artifacts.write_artifact(ctx.work_dir, "aoti", {"device": "cpu", "requires": REQUIRES,
                                                        "load": "k3x.exporter.aoti.load_aoti"}) as tmp:
        compile_aoti(ep, tmp / PACKAGE)
    return f"aoti: {ctx.out_dir / PACKAGE} — runs only in {REQUIRES}"


def stage_onnx(ep: ExportedProgram, ctx: StageContext) -> str:
    from .onnx import OnnxOptions, onnx_stage

    art = onnx_stage(ctx.work_dir, ep, ctx.cfg, OnnxOptions(weights=ctx.options.weights,
                                                           weight_stream=ctx.weight_stream))
    where = ", ".join(f"{flavor} {ctx.out_dir / Path(path).name}" for flavor, path in art.files.items())
    data = f", weights in {ctx.out_dir / Path(art.external_data).name}" if art.external_data else ""
    if not ctx.options.weights:
        return f"onnx: {where}{data} (weightless: weights are graph inputs; no GenAI package)"
    from .genai import genai_stage  # the ort model wrapped for onnxruntime-genai, beside it

    return f"onnx: {where}{data}\n" + genai_stage(ctx.work_dir, ctx.cfg, art.files["ort"].name, ctx.out_dir)


def copy_tokenizer(checkpoint: Path, out_dir: Path) -> str:
    """Copy the checkpoint's tokenizer / generation files (model/tokenizer.TOKENIZER_FILES) into the export
    as artifact `tokenizer`, so `k3x run --prompt` and ONNX Runtime GenAI find them beside the models.
    Each must resolve inside the checkpoint folder (a symlink to a file elsewhere is refused, CheckpointError);
    copies never get wider permissions than their source (fileio.copy_file)."""
    import os

    from ..fileio import copy_file
    from ..model.checkpoint import checkpoint_file
    from ..model.tokenizer import TOKENIZER_FILES
    from . import artifacts

    checkpoint = Path(checkpoint)
    found = [checkpoint_file(checkpoint, n) for n in TOKENIZER_FILES if os.path.lexists(checkpoint / n)]
    found = [f for f in found if f.is_file()]
    if not found:
        return f"tokenizer: none in {checkpoint} (text prompts need tokenizer.json or tiktoken.model)"
    with artifacts.write_artifact(out_dir, "tokenizer") as tmp:
        for f in found:
            copy_file(f, tmp / f.name)
    return "tokenizer: " + ", ".join(f.name for f in found)


STAGES: dict[str, Stage] = {"pt2": stage_pt2, "onnx": stage_onnx, "aoti": stage_aoti}
# what each --target runs, in order, after the one trace
TARGET_STAGES: dict[Target, tuple[str, ...]] = {
    Target.PT2: ("pt2",),
    Target.ONNX: ("onnx",),
    Target.AOTI: ("aoti",),
    Target.ALL: ("pt2", "onnx", "aoti"),
}


# --- orchestration -------------------------------------------------------------------------------

@contextlib.contextmanager
def _timed(name: str, progress: Progress, timings: dict[str, float]) -> Iterator[None]:
    progress(name, None)
    t = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - t
    progress(name, timings[name])


def _check_fits_in_memory(cfg: K3Config, dtype: torch.dtype) -> None:
    import psutil

    from ..model.summary import weight_bytes

    need = weight_bytes(cfg, dtype)  # MXFP4 experts counted packed
    free = psutil.virtual_memory().available
    if need > free:
        raise _config_error(f"preset={cfg.name!r}: its weights need {need / 2**30:,.0f} GiB, "
                            f"{free / 2**30:,.0f} GiB is free; trace it with --no-weights")


def _load(options: ExportOptions, dtype: torch.dtype, *, stream: bool = False
          ) -> tuple[K3Config, Callable, str | None]:
    """(config, a function building the model, checkpoint hash) — config first, so it can be checked.
    `stream`: the weights will be streamed from the checkpoint by the stages, so the model is built on meta."""
    import dataclasses

    from ..custom_ops.kernels import Kernels
    from ..model import build_model
    from ..model.config import preset

    kernels = Kernels(KernelChoice(options.kernels).value)
    fmt = None if options.expert_format is None else ExpertFormat(options.expert_format).value

    if options.checkpoint is None:
        cfg = dataclasses.replace(preset(options.preset), kernels=kernels, expert_format=fmt or "dense",
                                  max_context=options.max_context)
        if options.weights:
            _check_fits_in_memory(cfg, dtype)
        seed = options.seed if options.weights else None
        device = "cpu" if options.weights else "meta"
        return cfg, lambda: build_model(cfg, device=device, dtype=dtype, seed=seed), None
    from ..model.checkpoint import checkpoint_config

    cfg = dataclasses.replace(checkpoint_config(options.checkpoint, fmt), kernels=kernels,
                              max_context=options.max_context)
    if not options.weights:  # the graph depends on the config alone; no need to hash the shards
        return cfg, lambda: build_model(cfg, device="meta", dtype=dtype, seed=None), None
    from ..model.checkpoint import checkpoint_hash, load_checkpoint

    if stream:
        return cfg, lambda: build_model(cfg, device="meta", dtype=dtype, seed=None), checkpoint_hash(options.checkpoint)
    _check_fits_in_memory(cfg, dtype)
    return cfg, lambda: load_checkpoint(options.checkpoint, dtype=dtype, device="cpu", kernels=kernels,
                                        expert_format=cfg.expert_format), \
        checkpoint_hash(options.checkpoint)


def _weight_stream(options: ExportOptions, dtype: torch.dtype, cfg: K3Config) -> Callable:
    from ..model.checkpoint_ranges import stream_weights

    return lambda: stream_weights(options.checkpoint, dtype=dtype, expert_format=cfg.expert_format)


def export(options: ExportOptions, progress: Progress | None = None) -> ExportResult:
    """Run every stage of `options.targets` into `options.out_dir`. Raises ConfigError (bad config or
    options, before anything is built) or the failing stage's error (nothing half-written)."""
    from . import artifacts
    from .trace import op_counts, trace

    progress = progress or (lambda name, seconds: None)
    stages = options.stages()
    dtype = artifacts.DTYPES[DType(options.dtype).value]
    timings: dict[str, float] = {}
    # pt2 / ONNX from a checkpoint: traced on meta, weights streamed tensor by tensor into each artifact
    # (exporter/pt2_weights.py, exporter/onnx_weights.py); AOTInductor compiles real weights: it loads the model
    stream = options.checkpoint is not None and options.weights and set(stages) <= {"pt2", "onnx"}
    with _timed("config", progress, timings):
        cfg, build, ckpt_hash = _load(options, dtype, stream=stream)
        # the TensorRT flavor of the ONNX export runs the Triton kernels in its plugins: their limits apply
        cfg.check_ops(kernels=cfg.kernels.value == "triton" or "onnx" in stages)
    from .staging import staged_export

    with staged_export(options.out_dir) as work:
        with _timed("model", progress, timings):
            model = build()
        with _timed("trace", progress, timings):
            ep = trace(model, cfg=cfg)
        with _timed("manifest", progress, timings):
            artifacts.init_manifest(work, cfg, dtype=dtype, weights=options.weights, op_counts=op_counts(ep),
                                    checkpoint=options.checkpoint, checkpoint_hash=ckpt_hash)
        ctx = StageContext(cfg, options, work, _weight_stream(options, dtype, cfg) if stream else None)
        notes = [copy_tokenizer(options.checkpoint, work)] if options.checkpoint else []
        for name in stages:
            with _timed(name, progress, timings):
                notes.append(str(STAGES[name](ep, ctx)))
    return ExportResult(options.out_dir, artifacts.read_manifest(options.out_dir), timings, notes)
