"""`k3x export` as one library call: source -> config check -> model -> trace -> manifest -> target stages.

    result = export(ExportOptions(targets=(Target.PT2, Target.ONNX), out_dir=Path("out"), preset="k3", weights=False))

Notable choices:
- The config is checked against what the ops support before anything is built or traced (each op family
  states its limits once, in custom_ops/<family>/op.py `check_config`); with the TensorRT ONNX flavor or
  `kernels=triton`, the Triton kernel limits too. A failure raises `ConfigError` naming the field.
- `kernels` (reference | triton) is the k3 custom-op implementation baked into the traced program; it is
  not the runner (`k3x run --backend`).
- Any rank count through the one `export` call: the options are resolved once (`resolve`: architecture
  + `ModelOptions`) and checked (`resolve_job`); the plan (`tp` x `ep`) picks the writer: one program
  (`write_program`) or one program per rank (exporter/ranks.write_ranks). The manifest records the
  architecture (`config`), the build and cache options (`options`) and, for ranks, the plan (`parallel`).
- `weights=False` builds on the meta device: any size traces on an ordinary CPU machine.
- `dtype=auto` (the default): the checkpoint's stored dtype or the preset's default (exporter/presets.py);
  the export's first output line says which and why. A re-export's last line names what it replaced.
- From a checkpoint, pt2 and ONNX never hold the model: it is traced on meta and each stage streams the
  checkpoint's tensors into its artifact (`StageContext.weight_stream`); aoti (AOTInductor compiles real
  weights) loads the model as before.
- `--weights reference` (`ExportOptions.weight_source`): the same meta trace, but no stage writes weights: the
  manifest's `weight_source` names the checkpoint's files (size, sha256; checkpoint/reference.py) and the
  runners read them at load (runtime/referenced.py).
- Whole exports (folder/staging.py): everything is written into a sibling temporary folder
  (`StageContext.work_dir`) that replaces `out_dir` only once every stage succeeded; `out_dir` must be
  missing, empty or an earlier k3x export, and is locked against concurrent exports.
- Every target consumes the one traced `ExportedProgram`. A stage is a plain function
  `stage(ep, ctx) -> str` (a line for the user) that writes its files through
  `artifacts.write_artifact`, so each artifact is renamed into place and listed in the manifest.
- The request and its resolved job (`ExportOptions`, `ExportJob`, `TARGET_STAGES`) live in exporter/options.py,
  imported from there by callers, by this module and by exporter/ranks.py, so the two writers never import
  each other. Adding a target (e.g. ONNX) = one `Target` member and one `TARGET_STAGES` entry there, one
  `STAGES` entry here:
      class Target: ONNX = "onnx"; ALL = "all"
      STAGES["onnx"] = stage_onnx
      TARGET_STAGES[Target.ONNX] = ("onnx",);  TARGET_STAGES[Target.ALL] = ("pt2", "onnx", "aoti")
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .options import (Activations, DType, ExpertFormat, ExportJob, ExportOptions, KernelChoice, Progress, Timed,
                      TraceMode, Trunk, config_error, timed_step)
from .tokenizer import copy_tokenizer, tokenizer_files

if TYPE_CHECKING:  # this module is imported by the CLI: torch only inside functions
    import torch
    from torch.export import ExportedProgram

    from ..model.config import K3Config
    from ..model.options import ModelOptions


@dataclass(frozen=True)
class StageContext:
    cfg: K3Config
    options: ExportOptions
    work_dir: Path  # where stages write (renamed to out_dir when the export is complete)
    weight_stream: Callable | None = None  # the checkpoint's tensors one by one (a meta-traced program)
    model: ModelOptions | None = None  # the build and cache options the program was traced with
    stamped: bool = False  # traced by exporter/stamp.py: pt2 saved by exporter/stamp_save.py

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


# --- target stages -------------------------------------------------------------------------------

def stage_pt2(ep: ExportedProgram, ctx: StageContext) -> str:
    from ..folder import artifacts
    from .onnx import REFERENCED
    from .stamp_save import save_recorded

    name, digests = "model.pt2", {}
    weights = REFERENCED if ctx.options.references_checkpoint else ctx.options.weights
    extra = {"weights": weights, "load": "k3x.exporter.trace.load_pt2"}
    with artifacts.write_artifact(ctx.work_dir, "pt2", extra, digests=digests) as tmp:
        if ctx.weight_stream is not None:  # traced on meta: weights written tensor by tensor from the checkpoint
            from .pt2_weights import save_streamed_pt2

            def write(save):
                return save_streamed_pt2(ep, tmp / name, ctx.weight_stream(), save=save)
        else:
            from .trace import save_pt2

            def write(save):
                save_pt2(ep, tmp / name, save=save)
        # the manifest says which save wrote it: {"mode": "fast" | "torch", "fallback": why not fast, or null}
        digest, extra["save"] = save_recorded(write, stamped=ctx.stamped)
        if digest is not None:
            digests[name] = digest
    if ctx.options.references_checkpoint:
        return f"pt2: {ctx.out_dir / name} (graph only: weights read from {ctx.options.checkpoint} at load)"
    if ctx.options.weights:
        return f"pt2: {ctx.out_dir / name}"
    return (f"pt2: {ctx.out_dir / name} (weightless: names/shapes/dtypes only; "
            "attach weights with k3x.exporter.trace.with_weights)")


def stage_aoti(ep: ExportedProgram, ctx: StageContext) -> str:
    from ..folder import artifacts
    from .aoti import PACKAGE, REQUIRES, compile_aoti

    with artifacts.write_artifact(ctx.work_dir, "aoti", {"device": "cpu", "requires": REQUIRES,
                                                        "load": "k3x.exporter.aoti.load_aoti"}) as tmp:
        compile_aoti(ep, tmp / PACKAGE)
    return f"aoti: {ctx.out_dir / PACKAGE} — runs only in {REQUIRES}"


def stage_onnx(ep: ExportedProgram, ctx: StageContext) -> str:
    from .onnx import OnnxOptions, onnx_stage
    from .serving import serving_manifest

    serving = serving_manifest(ctx.cfg, ctx.options.block_size) if ctx.options.serving else None
    cache = ctx.model.cache if ctx.model else None
    trunk = ctx.model.build.trunk if ctx.model else "dense"
    flavors = ("ort", "trt") if trunk == "dense" else ("ort",)  # TensorRT has no plugin for a CPU trunk's nodes
    art = onnx_stage(ctx.work_dir, ep, ctx.cfg, OnnxOptions(weights=ctx.options.weights, weight_stream=ctx.weight_stream,
                                                           cache=cache, serving=serving,
                                                           reference=ctx.options.references_checkpoint,
                                                           layer_functions=ctx.options.onnx_functions,
                                                           flavors=flavors))
    where = ", ".join(f"{flavor} {ctx.out_dir / Path(path).name}" for flavor, path in art.files.items())
    if trunk != "dense":
        where += f" (no trt flavor: TensorRT has no plugin for the {trunk} trunk; ONNX Runtime runs it on the CPU)"
    data = f", weights in {ctx.out_dir / Path(art.external_data).name}" if art.external_data else ""
    if not ctx.options.weights or serving is not None or ctx.options.references_checkpoint:
        why = "serving step" if serving is not None else "weightless: weights are graph inputs" \
            if not ctx.options.weights else f"graph only: weights read from {ctx.options.checkpoint} at load"
        return f"onnx: {where}{data} ({why}; no GenAI package)"
    from .genai import genai_stage  # the ort model wrapped for onnxruntime-genai, beside it

    return f"onnx: {where}{data}\n" + genai_stage(ctx.work_dir, ctx.cfg, art.files["ort"].name, ctx.out_dir, cache)


STAGES: dict[str, Stage] = {"pt2": stage_pt2, "onnx": stage_onnx, "aoti": stage_aoti}


# --- orchestration -------------------------------------------------------------------------------

def resolve(options: ExportOptions) -> tuple[K3Config, ModelOptions]:
    """(architecture, build and cache options) of an export: a preset (dense experts unless asked) or a
    checkpoint's config.json (experts as stored unless `expert_format` says otherwise)."""
    from ..model.config import preset
    from ..model.options import BuildOptions, CacheOptions, ModelOptions
    from ..plan.kernels import Kernels

    kernels = Kernels(KernelChoice(options.kernels).value)
    fmt = None if options.expert_format is None else ExpertFormat(options.expert_format).value
    acts, trunk = Activations(options.activations).value, Trunk(options.trunk).value
    if options.checkpoint is None:
        cfg, build = preset(options.preset), BuildOptions(kernels, fmt or "dense", acts, trunk)
    else:
        from ..checkpoint.files import checkpoint_config

        cfg, build = checkpoint_config(options.checkpoint, fmt, kernels=kernels, activations=acts)
        build = dataclasses.replace(build, trunk=trunk)
    return cfg, ModelOptions(build, CacheOptions(options.max_context))


def _check_fits_in_memory(cfg: K3Config, build, dtype: torch.dtype) -> None:
    import psutil

    from ..model.summary import weight_bytes

    need = weight_bytes(cfg, dtype, build)  # MXFP4 experts counted packed
    free = psutil.virtual_memory().available
    if need > free:
        raise config_error(f"preset={cfg.name!r}: its weights need {need / 2**30:,.0f} GiB, "
                            f"{free / 2**30:,.0f} GiB is free; trace it with --no-weights")


def resolve_job(options: ExportOptions) -> ExportJob:
    """Resolve and check everything before anything is built: ConfigError naming the field."""
    from ..folder import artifacts
    from .presets import dtype_line, model_dtype

    stages, plan = options.stages(), options.plan()
    name, why = model_dtype(DType(options.dtype).value, options.preset, options.checkpoint)
    if Trunk(options.trunk) != Trunk.DENSE:  # the projections' weights are the trunk's; everything else fp32
        name, why = "fp32", f"--trunk {Trunk(options.trunk).value}: fp32 activations, {Trunk(options.trunk).value} " \
                            "projection weights"
    dtype = artifacts.DTYPES[name]
    cfg, model = resolve(options)
    # the TensorRT flavor of the ONNX export runs the Triton kernels in its plugins: their limits apply
    model.check(cfg, kernel_limits="onnx" in stages)
    plan.check(cfg)
    if options.serving and options.block_size > cfg.max_position_embeddings:  # no run could fill one block
        raise config_error(f"--block-size {options.block_size}: over the model's context of "
                           f"{cfg.max_position_embeddings} positions (max_position_embeddings); a block must fit it")
    # pt2 / ONNX from a checkpoint: traced on meta, weights streamed tensor by tensor into each artifact
    # (exporter/pt2_weights.py, exporter/onnx_weights.py); AOTInductor compiles real weights: it loads the model
    stream = plan.world == 1 and options.checkpoint is not None and options.weights and set(stages) <= {"pt2", "onnx"}
    if plan.world == 1 and options.weights and not stream:
        _check_fits_in_memory(cfg, model.build, dtype)
    ckpt_hash, source = None, None
    if options.references_checkpoint:  # every file's size and sha256, for the loader's check
        from ..checkpoint.reference import reference_entry

        source, ckpt_hash = reference_entry(options.checkpoint)
        if options.serving:  # the step holds the model as its `lm` child: the programs' weight names
            from .serving import WEIGHT_PREFIX

            source["prefix"] = WEIGHT_PREFIX
    elif options.checkpoint is not None and options.weights:  # the graph alone depends on the config
        from ..checkpoint.reference import checkpoint_hash

        ckpt_hash = checkpoint_hash(options.checkpoint)
    if options.checkpoint is not None:  # a tokenizer file out of the folder refused now (the copy checks again)
        tokenizer_files(options.checkpoint)
    return ExportJob(options, cfg, model, plan, dtype, ckpt_hash, source, stream,
                     dtype_line(name, why, onnx="onnx" in stages))


def _build(job: ExportJob):
    """The whole model: on meta (no weights, or weights streamed by the stages), a preset's random init,
    or loaded from the checkpoint."""
    from ..model import build_model

    o, build = job.options, job.model.build
    if not o.weights or job.stream:
        return build_model(job.cfg, build, device="meta", dtype=job.dtype, seed=None)
    if o.checkpoint is None:
        return build_model(job.cfg, build, device="cpu", dtype=job.dtype, seed=o.seed)
    from ..checkpoint.files import load_checkpoint
    from ..model.trunk import convert_trunk

    model = load_checkpoint(o.checkpoint, dtype=job.dtype, device="cpu", kernels=build.kernels,
                            expert_format=build.expert_format, activations=build.activations)
    return convert_trunk(model, build.trunk)


def _weight_stream(job: ExportJob) -> Callable:
    """The checkpoint's tensors in state_dict order, named as the traced program names them (a serving step
    holds the model as a child: exporter/serving.py WEIGHT_PREFIX)."""
    from .serving import WEIGHT_PREFIX
    from .trunk_weights import trunk_stream

    prefix = WEIGHT_PREFIX if job.options.serving else ""

    def stream():
        for name, tensor in trunk_stream(job.options.checkpoint, job.cfg, job.dtype, job.model.build):
            yield prefix + name, tensor

    return stream


def write_program(work: Path, job: ExportJob, timed: Timed) -> list[str]:
    """One program (world size 1): trace, manifest, tokenizer, then every target stage from the one trace."""
    from ..folder import artifacts
    from .serving import serving_manifest, trace_serving
    from .stamp import trace_recorded
    from .trace import op_counts

    with timed("model"):
        model = _build(job)
    o = job.options
    with timed("trace"):
        ep, traced = (trace_serving(model, block_size=o.block_size, kernels=job.model.build.kernels.value),
                      {"mode": "per-layer", "fallback": None}) if o.serving \
            else trace_recorded(model, cache=job.model.cache, mode=TraceMode(o.trace_mode).value)
    with timed("manifest"):
        serving = serving_manifest(job.cfg, o.block_size) if o.serving else None
        artifacts.init_manifest(work, job.cfg, dtype=job.dtype, weights=o.weights, op_counts=op_counts(ep),
                                checkpoint=o.checkpoint, checkpoint_hash=job.checkpoint_hash, options=job.model,
                                serving=serving, trace=traced, weight_source=job.weight_source)
    stream = job.stream and job.weight_source is None  # a reference: the artifacts hold the graph only
    ctx = StageContext(job.cfg, o, work, _weight_stream(job) if stream else None, job.model,
                       stamped=traced["mode"] == "stamped")
    notes = [copy_tokenizer(o.checkpoint, work)] if o.checkpoint else []
    for name in o.stages():
        with timed(name):
            notes.append(str(STAGES[name](ep, ctx)))
    return notes


def export(options: ExportOptions, progress: Progress | None = None) -> ExportResult:
    """Export `options` into `options.out_dir`, for any rank count: one program (tp = ep = 1) or one program
    per rank of the plan (exporter/ranks.py). Raises ConfigError (bad config or options, before anything is
    built) or the failing stage's error (nothing half-written: the folder is staged, folder/staging.py)."""
    from ..folder import artifacts
    from ..folder.staging import replaced_files, replaced_line, staged_export

    progress = progress or (lambda name, seconds: None)
    timings: dict[str, float] = {}

    def timed(name: str) -> contextlib.AbstractContextManager[None]:
        return timed_step(name, progress, timings)

    with timed("config"):
        job = resolve_job(options)
    if job.plan.world == 1:
        write = write_program
    else:
        from .ranks import write_ranks as write
    with staged_export(options.out_dir) as work:
        notes = [job.dtype_note] + write(work, job, timed)
        replaced = replaced_files(options.out_dir)  # the lock held: what the rename is about to replace
    if replaced:
        notes.append(replaced_line(options.out_dir, replaced))
    return ExportResult(options.out_dir, artifacts.read_manifest(options.out_dir), timings, notes)
