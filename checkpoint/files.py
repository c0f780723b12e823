"""Hugging Face-style checkpoints: `config.json` + one or many `*.safetensors` (+ `model.safetensors.index.json`).

Loading validates every tensor's name, shape and dtype from the safetensors headers BEFORE any weight is
allocated (missing, unexpected, wrong shape/dtype, unreadable file, config that does not fit: one clear
`CheckpointError` naming the tensor and file, no partial model). Then the model is materialised once and
filled tensor by tensor from memory-mapped files, so two copies of the weights never coexist.

Names: the model's own parameter names, except stacked experts: `...experts.{e}.w1.weight` (or the
compressed-tensors MXFP4 pair `weight_packed` + `weight_scale`) fills row e of `...experts.w1`.
MXFP4 experts are kept packed by default (`expert_format=None` -> "mxfp4" when every expert is stored packed;
the model then holds `experts.w1` u8 `[E, I, L/2]` + `experts.w1_scale` u8 `[E, I, L/32]`, i.e. about the
checkpoint's bytes); `expert_format="dense"` decodes them on load into float experts.
`A_log` may be stored longer than the head count (K3 stores 128 for 96 heads) or as `[1, 1, H, 1]` (Kimi
Linear): the first H values are used. A `language_model.` prefix is stripped; vision-tower tensors are ignored.
Names as transformers 5 writes them are renamed at load (`hf_transformers.WEIGHT_RENAMES`). So both k3x's
earlier layout (no prefix, `A_log` `[H]`) and the published ones read; `save_checkpoint` writes the published
layout of the architecture (checkpoint/published.py). Packed experts need config.json's compressed-tensors
`quantization_config` (`published.check_quantization`), else the checkpoint is refused.

A checkpoint folder is not trusted: every file read from it (config.json, the index, every shard the index
names, the tokenizer files) must resolve (symlinks followed) directly inside the folder, or into its repository's
blobs/ when the folder is a Hugging Face hub snapshot (`checkpoint_file`, fileio.confined); a tensor in two
shards, a tensor in a shard that the index does not list, or one the index lists in a shard that lacks it is a
`CheckpointError` naming tensor and files. Each shard is opened once (`Shards`). `checkpoint_hash`
(checkpoint/reference.py) covers exactly the files the weights come from (config.json, the index, the shards in
use), so any change to them reads as "changed since the export". Writing one: checkpoint/save.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from ..fileio import confined
from ..model import mxfp4
from ..model.config import ConfigError, K3Config
from ..model.init import build_model
from ..model.model import K3ForCausalLM
from ..model.options import BuildOptions
from ..plan.kernels import Kernels
from . import published
from .hf_config import config_from_hf, raw_config
from .hf_transformers import rename_weight

INDEX = "model.safetensors.index.json"
IGNORED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "mm_projector.")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale|weight_shape)$")
_FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded; the message names the tensor and/or file."""


@dataclass(frozen=True)
class _Slot:
    param: str  # model parameter/buffer name
    expert: int | None  # row of a stacked expert tensor
    part: str  # "weight" | "weight_packed" | "weight_scale" | "weight_shape"


def _canonical(name: str) -> str | None:
    if name.startswith("language_model."):
        name = name[len("language_model."):]
    return None if name.startswith(IGNORED_PREFIXES) else rename_weight(name)


def slot(name: str) -> _Slot:
    m = _EXPERT.match(name)
    if m:
        return _Slot(f"{m.group(1)}.{m.group(3)}", int(m.group(2)), m.group(4))
    return _Slot(name, None, "weight")


class Shards(dict):
    """Open safetensors handles by file: each shard is opened once, however many tensors it holds."""

    def __missing__(self, f: Path):
        self[f] = h = _open(f)
        return h


def checkpoint_file(path: Path, name: object) -> Path:
    """`path / name` for any file read from a checkpoint folder (config, index, shards, tokenizer files),
    refused unless it resolves directly inside the folder (or, in a hub snapshot, its repository's blobs/:
    fileio.confined)."""
    return confined(path, name, error=CheckpointError, what="checkpoint folder")


def tensor_files(path: Path, shards: Shards | None = None) -> dict[str, Path]:
    """tensor name -> file, from the index when present (checked against the shards' own headers), else
    by reading every shard's header (a name in two shards is an error)."""
    shards = Shards() if shards is None else shards
    if not checkpoint_file(path, "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (not a checkpoint folder)")
    if checkpoint_file(path, INDEX).is_file():
        return index_files(path, weight_map(path, (path / INDEX).read_bytes()), shards)
    return header_files(path, sorted(path.glob("*.safetensors")), shards)


def weight_map(path: Path, index: bytes) -> dict[str, str]:
    """The {tensor: shard file name} of `index` (the bytes of `path`'s index)."""
    try:
        names = json.loads(index.decode("utf-8"))["weight_map"]
        if not isinstance(names, dict):
            raise TypeError("weight_map must be an object {tensor: shard file}")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointError(f"{path / INDEX}: unreadable index ({str(e)[:200]})") from None
    return names


def index_files(path: Path, names: dict[str, str], shards: Shards) -> dict[str, Path]:
    """tensor name -> file as the index's `names` say, checked against the shards' own headers."""
    files = {k: checkpoint_file(path, f) for k, f in names.items()}
    missing = sorted({f.name for f in files.values() if not f.is_file()})
    if missing:
        raise CheckpointError(f"{path / INDEX}: shard file(s) missing: {', '.join(missing)}")
    for f in sorted(set(files.values())):
        for k in shards[f].keys():
            if k not in files:
                raise CheckpointError(f"{f}: tensor {k!r} is in this shard but not in {INDEX}")
            if files[k] != f:
                raise CheckpointError(f"{f}: tensor {k!r} is also in this shard; {INDEX} says {files[k].name}")
    return files


def header_files(path: Path, found: list[Path], shards: Shards) -> dict[str, Path]:
    """tensor name -> file from the headers of the shards `found` (no index): a name in two is an error."""
    if not found:
        raise CheckpointError(f"{path}: no *.safetensors files")
    out: dict[str, Path] = {}
    for f in found:
        checkpoint_file(path, f.name)
        for k in shards[f].keys():
            if k in out:
                raise CheckpointError(f"{path}: tensor {k!r} is in both {out[k].name} and {f.name} (and no {INDEX} "
                                      "says which to use)")
            out[k] = f
    return out


def _open(f: Path):
    try:
        return safe_open(str(f), framework="pt")
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
        raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None


def _expected_shape(meta: dict[str, torch.Tensor], s: _Slot) -> tuple[int, ...]:
    full = tuple(meta[s.param].shape)
    if s.expert is None:
        return full
    out, inp = full[1:]
    if meta[s.param].dtype == torch.uint8:  # a packed model: [E, out, in/2]
        inp *= 2
        if s.part == "weight":
            return ("dense experts cannot fill a packed model (load with expert_format='dense')",)
    return {"weight": (out, inp), "weight_packed": (out, inp // 2), "weight_scale": (out, inp // mxfp4.BLOCK),
            "weight_shape": (2,)}[s.part]


def validate(cfg: K3Config, build: BuildOptions, files: dict[str, Path], handles: Shards) -> dict[str, tuple]:
    """Check names/shapes/dtypes against a meta model; return model-name -> (stored name, file)."""
    meta = dict(build_model(cfg, build, device="meta", seed=None).state_dict())
    plan: dict[str, tuple[str, Path]] = {}
    covered: dict[str, set] = {k: set() for k in meta}
    problems: list[str] = []
    for stored, f in sorted(files.items()):
        name = _canonical(stored)
        if name is None:
            continue
        s = slot(name)
        if s.param not in meta:
            problems.append(f"unexpected tensor {stored!r} in {f.name}")
            continue
        h = handles[f]
        try:
            sl = h.get_slice(stored)
        except Exception:
            raise CheckpointError(f"{f}: tensor {stored!r} listed in the index is not in the file") from None
        shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
        want = _expected_shape(meta, s)
        if s.param.endswith("A_log") and max(shape, default=0) >= want[0] and sum(d > 1 for d in shape) <= 1:
            want = shape  # [H], longer than H (K3: 128), or [1, 1, H, 1] (Kimi Linear): first H values used
        if shape != want:
            problems.append(f"{stored!r} in {f.name}: shape {list(shape)}, expected {list(want)}"
                            " (does config.json match these weights?)")
        want_dtype = {"weight_packed": {"U8"}, "weight_scale": {"U8"}, "weight_shape": {"I32", "I64"}}.get(
            s.part, _FLOAT_DTYPES)
        if dtype not in want_dtype:
            problems.append(f"{stored!r} in {f.name}: dtype {dtype}, expected one of {sorted(want_dtype)}")
        if name in plan:
            problems.append(f"{stored!r} in {f.name} and {plan[name][0]!r} in {plan[name][1].name} "
                            f"both fill {name!r}")
        covered[s.param].add((s.expert, s.part))
        plan[name] = (stored, f)
    E = cfg.moe.num_experts
    for param, got in covered.items():
        if ".experts.w" in param and param.endswith("_scale"):
            continue  # filled by the `weight_scale` parts of `...experts.{e}.w*`
        if ".experts.w" in param:
            for e in range(E):
                parts = {p for (x, p) in got if x == e}
                if "weight" not in parts and not {"weight_packed", "weight_scale"} <= parts:
                    problems.append(f"missing tensor {param.rsplit('.', 1)[0]}.{e}.{param.rsplit('.', 1)[1]}.weight"
                                    " (or its weight_packed + weight_scale)")
                    break
        elif not got:
            problems.append(f"missing tensor {param!r}")
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise CheckpointError(f"checkpoint does not match config ({cfg.name}):\n  {shown}")
    return plan


def stored_expert_format(files: dict[str, Path]) -> str:
    """"mxfp4" when the checkpoint stores routed experts and every one of them packed, else "dense"."""
    parts = {slot(n).part for n in filter(None, map(_canonical, files)) if slot(n).expert is not None}
    return "mxfp4" if parts and "weight" not in parts else "dense"


def checkpoint_config(path: str | Path, expert_format: str | None = None, files: dict[str, Path] | None = None,
                      kernels: Kernels = Kernels.REFERENCE, activations: str = "bf16", config: bytes | None = None
                      ) -> tuple[K3Config, BuildOptions]:
    """(config.json's architecture (`config`: its bytes, already read), the build: `kernels`, experts as
    stored or as `expert_format` asks, the expert-GEMM `activations`)."""
    path = Path(path)
    if expert_format not in (None, "dense", "mxfp4"):
        raise CheckpointError(f"expert_format={expert_format!r}: expected 'dense', 'mxfp4' or None (as stored)")
    try:
        config_path = checkpoint_file(path, "config.json")
        cfg = config_from_hf(config_path, config)
        files = tensor_files(path) if files is None else files
        published.check_quantization(raw_config(config_path, config), published.holds_packed(files), str(config_path))
        fmt = expert_format or stored_expert_format(files)
        return cfg, BuildOptions(Kernels(kernels), fmt, activations)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def stored_pieces(plan: dict[str, tuple[str, Path]], targets: dict[str, torch.Tensor]) -> dict[str, list]:
    """model tensor name -> its stored pieces [(slot, stored name, file)] (scales of a packed model fill
    `...experts.w1_scale`; a dense model decodes `weight_packed` with its scale, looked up in `plan`)."""
    out: dict[str, list] = {}
    for name, (stored, f) in plan.items():
        s = slot(name)
        if s.part == "weight_shape" or (s.part == "weight_scale" and targets[s.param].dtype != torch.uint8):
            continue  # informational / consumed with weight_packed when decoding
        out.setdefault(s.param + ("_scale" if s.part == "weight_scale" else ""), []).append((s, stored, f, name))
    return out


def read_into(target: torch.Tensor, pieces: list, plan: dict, handles: Shards, unmap_every: int | None = None) -> None:
    """Read one model tensor's pieces from the memory-mapped shards into `target` (one piece at a time).
    `unmap_every`: close the shard handles (unmapping the pages read, which count as resident memory) after
    about this many bytes."""
    read = 0
    for s, stored, f, name in pieces:
        t = handles[f].get_tensor(stored)
        read += t.nbytes
        if unmap_every is not None and read >= unmap_every:
            handles.clear()
            read = 0
        if s.part == "weight_scale" and (t == 0xFF).any():
            raise CheckpointError(f"{stored!r} in {f.name}: mxfp4: weight_scale holds 0xFF, the E8M0 NaN encoding")
        if s.part == "weight_packed" and target.dtype != torch.uint8:
            sstored, sf = plan[name.replace("weight_packed", "weight_scale")]
            try:
                t = mxfp4.dequantize(t, handles[sf].get_tensor(sstored), torch.float32)
            except ValueError as e:
                raise CheckpointError(f"{sstored!r} in {sf.name}: {e}") from None
        if s.param.endswith("A_log"):
            t = t.reshape(-1)[: target.shape[0]]
        (target if s.expert is None else target[s.expert]).copy_(t)


def open_checkpoint(path: Path, dtype: torch.dtype, kernels: Kernels, expert_format: str | None,
                    activations: str = "bf16"):
    """(config, validated plan, shard handles, meta model) — nothing allocated yet."""
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (not a checkpoint folder)")
    handles = Shards()
    files = tensor_files(path, handles)
    cfg, build = checkpoint_config(path, expert_format, files, kernels, activations)
    plan = validate(cfg, build, files, handles)
    return cfg, plan, handles, build_model(cfg, build, device="meta", dtype=dtype, seed=None)


@torch.no_grad()
def load_checkpoint(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    kernels: Kernels = Kernels.REFERENCE, expert_format: str | None = None,
                    activations: str = "bf16") -> K3ForCausalLM:
    """`expert_format`: None keeps the experts as stored (MXFP4 stays packed), "dense" decodes them to `dtype`,
    "mxfp4" requires them packed. `activations`: the expert-GEMM input format (model/options.BuildOptions)."""
    cfg, plan, handles, model = open_checkpoint(Path(path), dtype, kernels, expert_format, activations)
    model = model.to_empty(device=device)
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, pieces in stored_pieces(plan, targets).items():
        read_into(targets[name], pieces, plan, handles)
    return model.eval()


def stream_tensors(path: str | Path, *, dtype: torch.dtype = torch.float32, expert_format: str | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state_dict, one tensor at a time, read from the memory-mapped shards as `load_checkpoint`
    would (same names, dtypes, packing): an exporter writes each and drops it, so at most one model tensor
    (one stacked expert tensor at most) plus 256 MiB of mapped shard pages is resident. Validation happens
    before the first tensor."""
    return tensors_of(*open_checkpoint(Path(path), dtype, Kernels.REFERENCE, expert_format))


def tensors_of(cfg: K3Config, plan: dict, handles: Shards, meta: K3ForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """`stream_tensors` of a checkpoint already opened and validated (`open_checkpoint`'s result)."""
    state = meta.state_dict()
    pieces = stored_pieces(plan, dict(meta.named_parameters()) | dict(meta.named_buffers()))
    with torch.no_grad():
        for name, m in state.items():
            t = torch.empty(m.shape, dtype=m.dtype)
            read_into(t, pieces[name], plan, handles, unmap_every=256 << 20)
            handles.clear()  # mapped shard pages count as resident: read what one tensor needs, unmap
            yield name, t
            del t  # before the next tensor is allocated
