"""Runners: one interface, `infer(feeds) -> outputs`, over every way k3x can execute a model (Polygraphy).

Feeds and outputs are `dict[str, Tensor]` named as the ONNX graph is (docs/architecture.md): `input_ids`,
`past.{i}.conv|recurrent`, `past_key_values.{i}.latent` -> `logits`, `present.{i}.*`. Every runner
takes and returns torch tensors, so the comparator and the decode loop never care which one runs.

Adding a runner (e.g. TensorRT) = one class with `name` and `infer`, plus one `RUNNERS` entry whose
factory takes `(export_dir, RunnerOptions)`.

Runners: `ModuleRunner` (eager model, ExportedProgram, AOTInductor package), `OrtRunner`
(exporter/ort_runner.py), `TrtRunner` (exporter/trt_runner.py). Heavy imports (onnxruntime, tensorrt)
happen only when such a runner is built, with a clear error when missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch
from torch import Tensor

from ..model.sampling import Generation, SamplingOptions, decode_loop
from ..model.state import state_specs

Feeds = dict[str, Tensor]


class RunnerError(RuntimeError):
    """A runner cannot be built or run; the message names the file, tensor or provider."""


class Runner(Protocol):
    name: str

    def infer(self, feeds: Feeds) -> Feeds: ...


@dataclass(frozen=True)
class RunnerOptions:
    provider: str = "auto"  # ONNX Runtime: auto | cuda | cpu
    checkpoint: Path | None = None  # eager: overrides the checkpoint recorded in the export
    intra_op_threads: int = 0  # ONNX Runtime: 0 = its default


class ModuleRunner:
    """Eager PyTorch model or an ExportedProgram's module: flat state list in, flat state list out."""

    def __init__(self, name: str, module: Callable, cfg) -> None:
        self.name, self.module, self.specs = name, module, state_specs(cfg)

    @torch.no_grad()
    def infer(self, feeds: Feeds) -> Feeds:
        missing = [n for n in ["input_ids"] + [s.input_name for s in self.specs] if n not in feeds]
        if missing:
            raise RunnerError(f"{self.name}: missing feed(s) {missing}")
        logits, present = self.module(feeds["input_ids"], [feeds[s.input_name] for s in self.specs])
        out = {"logits": logits, **{s.output_name: t for s, t in zip(self.specs, present)}}
        return out


def start_feeds(cfg, input_ids: Tensor, dtype: torch.dtype = torch.float32) -> Feeds:
    """Feeds of a prefill: the prompt [B, T] plus the empty state (zeros; MLA caches with past_seq = 0)."""
    from ..model.state import empty_state

    state = empty_state(cfg, input_ids.shape[0], dtype)
    return {"input_ids": input_ids, **{s.input_name: t for s, t in zip(state_specs(cfg), state)}}


def next_feeds(cfg, outputs: Feeds, input_ids: Tensor) -> Feeds:
    """Feeds for the next step: the new tokens plus every `present.*` renamed to its `past.*` input."""
    return {"input_ids": input_ids, **{s.input_name: outputs[s.output_name] for s in state_specs(cfg)}}


# --- factories over an export folder -------------------------------------------------------------

def _folder(export_dir: Path):
    from .artifacts import ExportFolder, ManifestError

    try:
        return ExportFolder.open(export_dir)
    except ManifestError as e:
        raise RunnerError(f"{export_dir}: not a k3x export folder ({e})") from None


def _artifact(export_dir: Path, name: str) -> Path:
    from .artifacts import ManifestError

    try:
        path = _folder(export_dir).artifact(name)
    except ManifestError as e:
        raise RunnerError(str(e)) from None
    if not path.is_file():
        raise RunnerError(f"{path}: listed in the manifest but missing")
    return path


def _eager(export_dir: Path, options: RunnerOptions) -> Runner:
    from ..model.checkpoint import CheckpointError, checkpoint_hash, load_checkpoint

    d = _folder(export_dir)
    ckpt = options.checkpoint or d.checkpoint()
    if ckpt is None:
        raise RunnerError(f"{export_dir}: the export records no checkpoint; pass --checkpoint for the eager reference")
    recorded = (d.manifest.get("checkpoint") or {}).get("hash")
    if options.checkpoint is None and recorded and Path(ckpt).is_dir() and checkpoint_hash(ckpt) != recorded:
        raise RunnerError(f"{ckpt}: changed since the export (sha256 {checkpoint_hash(ckpt)} != {recorded} in "
                          f"{export_dir}/manifest.json); re-export, or pass --checkpoint to compare anyway")
    try:
        model = load_checkpoint(ckpt, dtype=d.dtype(), device="cpu")
    except (CheckpointError, FileNotFoundError) as e:
        raise RunnerError(f"eager reference: {e}") from None
    if model.cfg.hash() != d.config().hash():
        raise RunnerError(f"{ckpt}: its config ({model.cfg.name}) differs from the export's ({d.config().name})")
    return ModuleRunner("eager", model, model.cfg)


def _pt2(export_dir: Path, options: RunnerOptions) -> Runner:
    from .trace import load_pt2

    path = _artifact(export_dir, "pt2")
    if not _folder(export_dir).manifest.get("weights", True):
        raise RunnerError(f"{path}: weightless program (exported with --no-weights); it cannot run")
    try:
        ep = load_pt2(path)
    except Exception as e:  # noqa: BLE001 - name the file
        raise RunnerError(f"{path}: cannot load the ExportedProgram: {e}") from None
    return ModuleRunner("pt2", ep.module(), _folder(export_dir).config())


def _ort(export_dir: Path, options: RunnerOptions) -> Runner:
    from .ort_runner import OrtRunner

    path = _artifact(export_dir, "onnx")  # the artifact exists and its first file is present
    entry = _folder(export_dir).manifest["artifacts"]["onnx"]
    if entry.get("weights") is False:
        raise RunnerError(f"{path}: weightless ONNX (exported with --no-weights: weights are graph inputs); "
                          "it cannot run — export with weights")
    name = entry.get("flavors", {}).get("ort")
    if name is None:
        raise RunnerError(f"{export_dir}: the onnx artifact has no ort flavor (flavors: {entry.get('flavors')}); "
                          "re-export with the ort flavor")
    return OrtRunner(Path(export_dir) / name, provider=options.provider,
                     intra_op_threads=options.intra_op_threads)


def _trt(export_dir: Path, options: RunnerOptions) -> Runner:
    from .trt_runner import TrtRunner  # TensorRT 11 + GPU; imports tensorrt only when built

    return TrtRunner(export_dir)


def _aoti(export_dir: Path, options: RunnerOptions) -> Runner:
    from .aoti import load_aoti

    return ModuleRunner("aoti", load_aoti(_artifact(export_dir, "aoti")), _folder(export_dir).config())


RUNNERS: dict[str, Callable[[Path, RunnerOptions], Runner]] = {
    "eager": _eager, "pt2": _pt2, "ort": _ort, "trt": _trt, "aoti": _aoti,
}


def make_runner(backend: str, export_dir: Path, options: RunnerOptions = RunnerOptions()) -> Runner:
    try:
        factory = RUNNERS[backend]
    except KeyError:
        raise RunnerError(f"backend={backend!r}: choose from {sorted(RUNNERS)}") from None
    return factory(Path(export_dir), options)


def generate(runner: Runner, cfg, prompt: Tensor, options: SamplingOptions, *, dtype: torch.dtype = torch.float32,
             on_token=None) -> Generation:
    """Prefill `prompt` [B, T], then T=1 steps carrying state; tokens chosen by the shared sampler."""
    out: Feeds = {}

    def prefill(ids: Tensor) -> Tensor:
        nonlocal out
        out = runner.infer(start_feeds(cfg, ids, dtype))
        return out["logits"][:, -1]

    def step(ids: Tensor) -> Tensor:
        nonlocal out
        out = runner.infer(next_feeds(cfg, out, ids))
        return out["logits"][:, -1]

    return decode_loop(prefill, step, prompt, options, on_token)


def prefill_logits(runner: Runner, cfg, ids: Tensor, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """logits [B, T, vocab] fp32 of one prefill call from an empty state (what `k3x logits` writes)."""
    if ids.dim() != 2 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise ValueError(f"input ids {list(ids.shape)}: need [B, T] with T >= 1 and ids in [0, {cfg.vocab_size})")
    return runner.infer(start_feeds(cfg, ids, dtype))["logits"].float().cpu()
