"""Runners: one interface, `infer(feeds) -> outputs`, over every way k3x can execute a model (Polygraphy).

Feeds and outputs are `dict[str, Tensor]` named as the ONNX graph is (docs/architecture.md): `input_ids`,
`past.{i}.conv|recurrent`, `past_key_values.{i}.latent` -> `logits`, `present.{i}.*`. Every runner
takes and returns torch tensors, so the comparator and the decode loop never care which one runs.

Adding a runner (e.g. TensorRT) = one class with `name` and `infer`, plus one `RUNNERS` entry whose
factory takes `(ExportFolder, RunnerOptions)`: the folder is opened once per command (`open_folder`).

Runners: `ModuleRunner` (eager model, ExportedProgram, AOTInductor package), `OrtRunner`
(runtime/ort_runner.py), `TrtRunner` (runtime/engine_runner.py). Heavy imports (onnxruntime, tensorrt)
happen only when such a runner is built, with a clear error when missing.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from ..folder.artifacts import ExportFolder, ManifestError
from ..model.options import CacheOptions
from ..model.state import state_specs
from ..text.sampling import Generation, SamplingOptions, decode_loop
from .base import Feeds, Runner, RunnerError, RunnerOptions, torch_threads_for
from .cuda_graph import require_cuda_graph
from .engine_runner import TrtRunner  # TensorRT 11 + GPU; imports tensorrt only when a runner is built
from .ort_runner import OrtRunner  # imports onnxruntime only when a runner is built
from .referenced import referenced_weights


class ModuleRunner:
    """Eager PyTorch model or an ExportedProgram's module: flat state list in, flat state list out."""

    def __init__(self, name: str, module: Callable, cfg, device: str | None = None,
                 cache: CacheOptions | None = None) -> None:
        self.name, self.module, self.specs = name, module, state_specs(cfg, cache)
        self.device = device  # where the module runs; feeds elsewhere are moved there (None: fed as given)

    @torch.no_grad()
    def infer(self, feeds: Feeds) -> Feeds:
        missing = [n for n in ["input_ids"] + [s.input_name for s in self.specs] if n not in feeds]
        if missing:
            raise RunnerError(f"{self.name}: missing feed(s) {missing}")
        ids, past = feeds["input_ids"], [feeds[s.input_name] for s in self.specs]
        if self.device is not None and any(t.device.type != self.device for t in [ids, *past]):
            ids, past = ids.to(self.device), [t.to(self.device) for t in past]
        logits, present = self.module(ids, past)
        out = {"logits": logits, **{s.output_name: t for s, t in zip(self.specs, present)}}
        return out


def start_feeds(cfg, input_ids: Tensor, dtype: torch.dtype = torch.float32, cache: CacheOptions | None = None
                ) -> Feeds:
    """Feeds of a prefill: the prompt [B, T] plus the empty state (zeros; MLA caches with past_seq = 0, or
    a static cache of `cache.max_context` positions and past_length 0)."""
    from ..model.state import empty_state

    state = empty_state(cfg, input_ids.shape[0], dtype, cache=cache)
    return {"input_ids": input_ids, **{s.input_name: t for s, t in zip(state_specs(cfg, cache), state)}}


def next_feeds(cfg, outputs: Feeds, input_ids: Tensor, cache: CacheOptions | None = None) -> Feeds:
    """Feeds for the next step: the new tokens plus every `present.*` renamed to its `past.*` input."""
    return _fed_forward(state_specs(cfg, cache), outputs, input_ids)


def _fed_forward(specs, outputs: Feeds, input_ids: Tensor) -> Feeds:
    """`next_feeds` over state specs already listed (a decode loop lists them once)."""
    return {"input_ids": input_ids, **{s.input_name: outputs[s.output_name] for s in specs}}


class DecodeSteps:
    """Batch-interface decode steps, each fed by the outputs of the step before (`next_feeds`). A runner that
    writes into tensors it is given (`binds_outputs`: ORT's IO binding) writes a step's states into the state
    tensors of the step before last (the feeds of the last step, which nothing reads once it has run), so the
    states alternate between two sets of tensors and the runner keeps its bindings of them
    (runtime/ort_runner.py `_bound`). Only tensors that this object's own steps returned are reused, never
    logits: outputs the caller got elsewhere (a prefill, a loaded state) are not written over. Only states whose
    shape a step keeps are held for reuse: a growing latent cache is not, so a step holds no more of it alive
    than before. The caller keeps no step's states once it has fed them to the next step."""

    def __init__(self, runner: Runner, cfg, cache: CacheOptions | None = None) -> None:
        self.runner, self.specs = runner, state_specs(cfg, cache)
        self.reuse = getattr(runner, "binds_outputs", False)
        self._last: Feeds | None = None  # what the last step returned
        self._spare: Feeds = {}  # states no step reads any more, by output name

    def __call__(self, outputs: Feeds, input_ids: Tensor) -> Feeds:
        """The step after `outputs` on the tokens `input_ids` [B, 1]."""
        feeds = _fed_forward(self.specs, outputs, input_ids)
        new = self.runner.infer(feeds, out=self._spare) if self._spare else self.runner.infer(feeds)
        ours = self.reuse and outputs is self._last
        self._spare = {s.output_name: feeds[s.input_name] for s in self.specs  # a growing cache would not fit
                       if feeds[s.input_name].shape == new[s.output_name].shape} if ours else {}
        self._last = new
        return new


# --- factories over an export folder -------------------------------------------------------------

def open_folder(export_dir: Path | ExportFolder) -> ExportFolder:
    """The export folder, its manifest read and checked once per command and then passed down: an
    `ExportFolder` is returned as it is, a path is opened (RunnerError naming the folder)."""
    if isinstance(export_dir, ExportFolder):
        return export_dir
    try:
        return ExportFolder.open(export_dir)
    except ManifestError as e:
        raise RunnerError(f"{export_dir}: not a k3x export folder ({e})") from None


def artifact_files(folder: ExportFolder, name: str, options: RunnerOptions) -> list[Path]:
    """The artifact's files (primary first) after the checks of folder/trust.py: inside the folder,
    present, and (unless options.check_hashes is off) with the manifest's sha256. Nothing is loaded before."""
    try:
        return folder.checked_files(name, check_hash=options.check_hashes)
    except ManifestError as e:
        raise RunnerError(str(e)) from None


def _eager(d: ExportFolder, options: RunnerOptions) -> Runner:
    from ..checkpoint.files import CheckpointError, load_checkpoint
    from ..checkpoint.reference import checkpoint_hash
    from ..model.trunk import convert_trunk

    ckpt = options.checkpoint or d.checkpoint()
    if ckpt is None:
        raise RunnerError(f"{d.path}: the export records no checkpoint; pass --checkpoint for the eager reference")
    recorded = (d.manifest.get("checkpoint") or {}).get("hash")
    try:
        now = checkpoint_hash(ckpt) if options.checkpoint is None and recorded and Path(ckpt).is_dir() else None
        if now is not None and now != recorded:
            raise RunnerError(f"{ckpt}: changed since the export (sha256 {now} != {recorded} in "
                              f"{d.path}/manifest.json); re-export, or pass --checkpoint to compare anyway")
        build = d.options().build
        model = convert_trunk(load_checkpoint(ckpt, dtype=d.dtype(), device="cpu", expert_format=build.expert_format,
                                              activations=build.activations), build.trunk)  # the export's own model
    except (CheckpointError, FileNotFoundError) as e:
        raise RunnerError(f"eager reference: {e}") from None
    cfg = d.config()  # a static latent cache is an export choice: the model serves it from the same weights
    if model.cfg.hash() != cfg.hash():
        raise RunnerError(f"{ckpt}: its config ({model.cfg.name}) differs from the export's ({cfg.name})")
    return ModuleRunner("eager", model.to(options.device), cfg, options.device, d.options().cache)


def serving_entry(export_dir: Path | ExportFolder) -> dict:
    """The manifest's `serving` entry (block_size, inputs, outputs) of a `k3x export --serving` folder, its
    `inputs` and `outputs` checked against the step program's own order (model/serving.py: the step inputs,
    then the pools in layer order): the pt2 and aoti runners feed the pools by position, so two names swapped
    in the manifest would feed a layer another layer's state. RunnerError naming the first entry that differs."""
    from ..model.serving import STEP_INPUTS, pool_names

    folder = open_folder(export_dir)
    entry = folder.manifest.get("serving")
    if not isinstance(entry, dict) or not isinstance(entry.get("block_size"), int):
        raise RunnerError(f"{folder.path}: not a serving export (no `serving` entry in manifest.json); "
                          "export with --serving")
    try:
        names = pool_names(folder.config())
    except ManifestError as e:
        raise RunnerError(str(e)) from None
    order = {"inputs": [*STEP_INPUTS, *(p for p, _ in names)], "outputs": ["logits", *(n for _, n in names)]}
    for key, want in order.items():
        got = entry.get(key)
        if got != want:
            got = got if isinstance(got, list) else []
            i = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
            seen = repr(got[i])[:60] if i < len(got) else "missing"
            takes = repr(want[i]) if i < len(want) else f"none (it has {len(want)})"
            raise RunnerError(f"{folder.path / 'manifest.json'}: serving.{key}[{i}] is {seen}, the step program's "
                              f"{key[:-1]} {i} is {takes} (its own order: step inputs, then the pools in layer "
                              "order); refused")
    return entry


def load_pt2_artifact(folder: ExportFolder, options: RunnerOptions, what: str):
    """The folder's pt2 program: hashed (unless options.check_hashes is off), checked and loaded from one
    open file (folder/trust.py `checked_pt2`), so the path cannot be swapped between check and load."""
    from ..exporter.trace import load_pt2
    from ..folder.trust import UnsafeArtifactError, checked_pt2

    path = artifact_files(folder, "pt2", replace(options, check_hashes=False))[0]  # hashed below, from the open file
    if not folder.manifest.get("weights", True):
        raise RunnerError(f"{path}: weightless program (exported with --no-weights); it cannot run")
    sha = folder.manifest["artifacts"]["pt2"]["files"][0]["sha256"] if options.check_hashes else None
    weights = referenced_weights(folder, options.check_hashes)  # a graph-only program: from the checkpoint
    try:
        with checked_pt2(path, sha256=sha) as f:
            ep = load_pt2(f)
    except UnsafeArtifactError as e:
        raise RunnerError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - name the file
        raise RunnerError(f"{path}: cannot load {what}: {e}") from None
    if weights is None:
        return ep
    from ..exporter.trace import with_weights

    return with_weights(ep, weights)


def _pt2(folder: ExportFolder, options: RunnerOptions) -> Runner:
    ep = load_pt2_artifact(folder, options, "the ExportedProgram")
    if options.device != "cpu":  # weights, constants and the devices named in the graph
        from torch.export.passes import move_to_device_pass

        ep = move_to_device_pass(ep, {"cpu": options.device})
    return ModuleRunner("pt2", ep.module(), folder.config(), options.device, folder.options().cache)


def _ort(folder: ExportFolder, options: RunnerOptions) -> Runner:
    files = artifact_files(folder, "onnx", options)  # the model and its external data, all checked
    path = files[0]
    entry = folder.manifest["artifacts"]["onnx"]
    if entry.get("weights") is False:
        raise RunnerError(f"{path}: weightless ONNX (exported with --no-weights: weights are graph inputs); "
                          "it cannot run — export with weights")
    name = entry.get("flavors", {}).get("ort")
    if name is None:
        raise RunnerError(f"{folder.path}: the onnx artifact has no ort flavor (flavors: {entry.get('flavors')}); "
                          "re-export with the ort flavor")
    if name not in {p.name for p in files}:
        raise RunnerError(f"{folder.path}: the ort flavor {str(name)[:80]!r} is not one of the onnx artifact's files")
    weights = referenced_weights(folder, options.check_hashes)
    return OrtRunner(folder.path / name, provider=options.provider,
                     intra_op_threads=options.intra_op_threads, collectives=bool(entry.get("collectives")),
                     profile=options.profile, weights=weights)


def _trt(folder: ExportFolder, options: RunnerOptions) -> Runner:
    artifact_files(folder, "trt", options)  # the engine is native code: only with the manifest's sha256
    return TrtRunner(folder.path)


def load_aoti_artifact(folder: ExportFolder, options: RunnerOptions) -> tuple[Callable, str]:
    """(the folder's AOTI package, loaded; the device it was compiled for). The package is trusted native
    code (exporter/aoti.py): loaded only once its sha256 matches, whatever options.check_hashes says."""
    from ..exporter.aoti import load_aoti

    path = artifact_files(folder, "aoti", replace(options, check_hashes=True))[0]
    return load_aoti(path), str(folder.manifest["artifacts"]["aoti"].get("device", "cpu"))


def _aoti(folder: ExportFolder, options: RunnerOptions) -> Runner:
    package, device = load_aoti_artifact(folder, options)
    return ModuleRunner("aoti", package, folder.config(), device, folder.options().cache)


RUNNERS: dict[str, Callable[[ExportFolder, RunnerOptions], Runner]] = {
    "eager": _eager, "pt2": _pt2, "ort": _ort, "trt": _trt, "aoti": _aoti,
}
# the one table of which artifact each runner needs (a rank folder holds pt2 / onnx: `RANK_RUNNERS`)
ARTIFACT_OF: dict[str, str] = {"pt2": "pt2", "ort": "onnx", "aoti": "aoti", "trt": "trt"}
RANK_RUNNERS = ("pt2", "ort")


def runnable(manifest: dict, runners: tuple[str, ...] = tuple(ARTIFACT_OF)) -> list[str]:
    """The runners (of `runners`) whose artifact the manifest lists with weights."""
    arts = manifest["artifacts"]
    return [r for r in runners if ARTIFACT_OF[r] in arts
            and arts[ARTIFACT_OF[r]].get("weights", manifest.get("weights", True)) is not False]


def make_runner(backend: str, export_dir: Path | ExportFolder, options: RunnerOptions = RunnerOptions()) -> Runner:
    """The `backend` runner over the export folder (an open `ExportFolder` is used as it is: no re-read)."""
    try:
        factory = RUNNERS[backend]
    except KeyError:
        raise RunnerError(f"backend={backend!r}: choose from {sorted(RUNNERS)}") from None
    if options.cuda_graph and not torch.cuda.is_available():  # before loading anything onto a missing device
        raise RunnerError(f"--cuda-graph: backend {backend}: no CUDA device (torch.cuda.is_available() is False)")
    try:
        runner = factory(open_folder(export_dir), options)
    except ManifestError as e:  # e.g. the manifest's config does not build
        raise RunnerError(str(e)) from None
    if options.cuda_graph:  # refused in one line where no graph can be captured (runtime/cuda_graph.py)
        runner = require_cuda_graph(runner, f"backend {backend}")
    return runner


def check_request(cfg, *, batch: int, prompt_len: int, new_tokens: int, dims: dict | None = None,
                  backend: str = "eager", dtype_bytes: int = 4, cache: CacheOptions | None = None) -> None:
    """Refuse, before anything runs, a request the model cannot serve: `batch` x `prompt_len` then
    `new_tokens` - 1 decode steps. Exported backends are bounded by the traced dynamic dims (`dims`, the
    manifest's `dynamic_dims`); every backend by the config's context length and, for the eager model
    (which materialises full attention), by an estimate of the prefill's memory against what is free."""
    if batch < 1 or prompt_len < 1 or new_tokens < 1:
        raise RunnerError(f"batch={batch}, prompt length={prompt_len}, new tokens={new_tokens}: each must be >= 1")
    positions = prompt_len + new_tokens - 1  # tokens fed to the model in all
    capacity = None if cache is None else cache.max_context
    if capacity is not None and positions > capacity:
        raise RunnerError(f"prompt length {prompt_len} + {new_tokens - 1} decode steps = {positions} positions: over "
                          f"the static latent cache (max_context={capacity}, set at export); use a shorter "
                          "request or re-export with a larger --max-context")
    if dims is not None:
        limits = [("batch", batch, "batch"), ("seq", prompt_len, "prompt length")] + [
            ("past_seq", positions - 1, "prompt length + decode steps - 1 (the cache length)")] * (capacity is None)
        for dim, value, what in limits:
            if dim in dims and value > dims[dim]["max"]:
                raise RunnerError(f"backend {backend}: {what} = {value} is over the exported maximum {dim}="
                                  f"{dims[dim]['max']} (DYNAMIC_DIMS at export time); use a shorter request")
    if positions > cfg.max_position_embeddings:
        raise RunnerError(f"prompt length {prompt_len} + {new_tokens - 1} decode steps = {positions} positions: "
                          f"over the model's context length (max_position_embeddings={cfg.max_position_embeddings})")
    if dims is not None:
        return
    import psutil

    heads = cfg.max_heads
    need = batch * prompt_len * (cfg.vocab_size + 16 * cfg.hidden_size) * 4 + batch * heads * prompt_len ** 2 * 4 * 2
    free = psutil.virtual_memory().available
    if need > free // 2:
        raise RunnerError(f"backend {backend}: batch {batch} x prompt length {prompt_len} needs about "
                          f"{need / 2**30:,.1f} GiB for the prefill, {free / 2**30:,.1f} GiB is free; use a shorter request")


def generate(runner: Runner, cfg, prompt: Tensor, options: SamplingOptions, *, dtype: torch.dtype = torch.float32,
             on_token=None, cache: CacheOptions | None = None, start: Feeds | None = None,
             on_prefill: Callable[[Feeds], None] | None = None) -> Generation:
    """Prefill `prompt` [B, T], then T=1 steps carrying state; tokens chosen by the shared sampler.
    `start`: the outputs of an earlier prefill of `prompt` (a state loaded from a file, runtime/state_file.py):
    not run again, its logits choose the first token. `on_prefill(outputs)`: called once the prefill ran."""
    out: Feeds = {}

    def prefill(ids: Tensor) -> Tensor:
        nonlocal out
        out = start if start is not None else runner.infer(start_feeds(cfg, ids, dtype, cache))
        if on_prefill is not None:
            on_prefill(out)
        return out["logits"][:, -1]

    steps = DecodeSteps(runner, cfg, cache)

    def step(ids: Tensor) -> Tensor:
        nonlocal out
        out = steps(out, ids)
        return out["logits"][:, -1]

    with torch_threads_for(runner):
        return decode_loop(prefill, step, prompt, options, on_token)


def prefill_logits(runner: Runner, cfg, ids: Tensor, *, dtype: torch.dtype = torch.float32,
                   cache: CacheOptions | None = None) -> Tensor:
    """logits [B, T, vocab] fp32 of one prefill call from an empty state (what `k3x logits` writes)."""
    if ids.dim() != 2 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise ValueError(f"input ids {list(ids.shape)}: need [B, T] with T >= 1 and ids in [0, {cfg.vocab_size})")
    return runner.infer(start_feeds(cfg, ids, dtype, cache))["logits"].float().cpu()
