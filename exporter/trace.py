"""Stage 1: `torch.export` of the K3 causal LM — one program serving prefill (empty past) and decode.

Dynamic dims are declared once here (`DYNAMIC_DIMS`) and reused by every later stage (ONNX dim_params,
TensorRT optimisation profiles). Inputs: `input_ids [batch, seq]` and the flat state of model/state.py
(`past_seq` on the MLA latent caches; with a static cache, CacheOptions.max_context, the caches have that fixed size
and `past_length` is a scalar input). Each custom op is one graph node (`op_counts`).

Notable choices:
- `trace` traces every layer; exporter/stamp.py traces each distinct decoder layer once and copies its graph
  for every layer, giving the same program (the export pipeline's default, `--trace-mode`).
- The fake-tensor dispatch cache is off while tracing. With three symbolic dims almost every op is a
  cache hit whose output is rebuilt from symbolic sizes/strides, which costs more than recomputing it.
  Same graph, CPU seconds of the trace (bench/export_full.py --baseline): k3 70.5 -> 50.5,
  kimi-linear-48b 16.4 -> 11.8. What remains is torch's per-node symbolic-shape work (~3 ms a node).
- `.pt2` files come from `torch.export.save` (a stamped program's from exporter/stamp_save.py: the same archive,
  each distinct node serialised once). A program traced on the meta device saves as a weightless
  archive: every parameter is recorded with name, shape and dtype but no bytes (torch 2.13 writes meta
  tensors as zero-length storage). `load_pt2` gives it back on meta; `with_weights` attaches real ones (no re-trace).
"""

from __future__ import annotations

import copy
import io
from collections import Counter
from pathlib import Path
from typing import BinaryIO, Callable

import torch
from torch.export import Dim, ExportedProgram
from torch.export.passes import move_to_device_pass

from ..folder.dims import DYNAMIC_DIMS
from ..model import K3Config, K3ForCausalLM
from ..model.options import CacheOptions
from ..model.state import state_specs


def torch_dims() -> dict[str, Dim]:
    return {n: Dim(n, min=r.min, max=r.max) for n, r in DYNAMIC_DIMS.items()}


def dynamic_shapes(cfg: K3Config, cache: CacheOptions | None = None) -> dict:
    d = torch_dims()
    past = [{0: d["batch"], 1: d["past_seq"]} if s.dims[1:2] == ("past_seq",)
            else {} if s.kind == "length" else {0: d["batch"]} for s in state_specs(cfg, cache)]
    return {"input_ids": {0: d["batch"], 1: d["seq"]}, "past": past}


def example_inputs(cfg: K3Config, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                   batch: int = 2, seq: int = 3, past_seq: int = 2, cache: CacheOptions | None = None
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Example inputs with every dynamic dim >= 2 (0/1 would specialise); values are irrelevant."""
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    past = [torch.zeros(s.shape(batch, past_seq), dtype=s.dtype(dtype), device=device)
            for s in state_specs(cfg, cache)]
    return ids, past


def trace(model: K3ForCausalLM, *, dtype: torch.dtype | None = None, cache: CacheOptions | None = None
          ) -> ExportedProgram:
    """Export `model` (real weights or the meta device) with the dynamic dims of DYNAMIC_DIMS, every layer traced
    (the stamped trace, exporter/stamp.py, gives the same program faster); `cache`: the latent cache interface to
    trace (default growing; a static cache adds `past_length`)."""
    p = next(model.parameters())
    dtype = dtype or p.dtype
    ids, past = example_inputs(model.cfg, dtype=dtype, device=p.device, cache=cache)
    with torch.no_grad(), torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
        return torch.export.export(model, (ids, past), dynamic_shapes=dynamic_shapes(model.cfg, cache))


class _WriteOnce(io.RawIOBase):
    """A file for torch's zip writer that keeps the first write error and swallows later writes.
    torch's writer writes its end-of-archive record from a C++ destructor; a write failing there (full
    disk) is a C++ exception in a destructor, i.e. `terminate` (exit 134). With this sink that last write
    goes nowhere and the first error is raised in Python instead."""

    def __init__(self, f) -> None:
        super().__init__()
        self.f, self.error = f, None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.f.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def write(self, data) -> int:
        if self.error is None:
            try:
                return self.f.write(data)
            except OSError as e:
                self.error = e
        return len(data)

    def flush(self) -> None:
        if self.error is None:
            self.f.flush()


def save_pt2(ep: ExportedProgram, path: str | Path, *, save: Callable[..., object] | None = None) -> None:
    """`torch.export.save` (or `save`, e.g. exporter/stamp_save.save_fast: the same archive); meta-device weights
    are stored as names, shapes and dtypes only. A failed write (full disk) is an OSError naming the file,
    never a process abort (`_WriteOnce`)."""
    with open(path, "wb") as f:
        sink = _WriteOnce(f)
        try:
            (save or torch.export.save)(ep, sink)
        except Exception:
            if sink.error is None:
                raise
        if sink.error is not None:
            raise OSError(sink.error.errno, f"{path}: {sink.error.strerror}") from None


def load_pt2(f: str | Path | BinaryIO) -> ExportedProgram:
    """Load a `.pt2` (a path, or a file object: folder/trust.py `checked_pt2` for one from an export folder)
    in any process: importing k3x.custom_ops registers the torch.ops.k3.* it calls."""
    from .. import custom_ops  # noqa: F401

    return torch.export.load(str(f) if isinstance(f, (str, Path)) else f)


def with_weights(ep: ExportedProgram, state_dict: dict[str, torch.Tensor], *,
                 device: str | torch.device = "cpu") -> ExportedProgram:
    """A copy of `ep` (e.g. a weightless `.pt2` traced on meta) with `state_dict` attached by name (cast to
    the traced dtype) and every device baked into the graph (`arange(..., device=meta)`) moved to `device`.
    Every parameter and buffer must be given, with the traced shape; `ep` itself is left as it was. The
    copy can be run (`.module()`), saved, or compiled (AOTInductor) like a program traced with weights."""
    missing = sorted(set(ep.state_dict) - set(state_dict))
    if missing:
        raise KeyError(f"with_weights: {len(missing)} tensors missing, e.g. {missing[:3]}")
    new_sd: dict[str, torch.Tensor] = {}
    for name, want in ep.state_dict.items():
        t = state_dict[name]
        if tuple(t.shape) != tuple(want.shape):
            raise ValueError(f"with_weights: {name} has shape {tuple(t.shape)}, the program wants {tuple(want.shape)}")
        t = t.detach().to(device=device, dtype=want.dtype)
        new_sd[name] = torch.nn.Parameter(t, want.requires_grad) if isinstance(want, torch.nn.Parameter) else t
    examples = None if ep.example_inputs is None else torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda x: torch.zeros(x.shape, dtype=x.dtype, device=device), ep.example_inputs)
    gm = copy.deepcopy(ep.graph_module)
    moved = ExportedProgram(root=gm, graph=gm.graph, graph_signature=ep.graph_signature,
                            state_dict=new_sd, range_constraints=ep.range_constraints,
                            module_call_graph=ep.module_call_graph, example_inputs=examples,
                            constants=ep.constants, verifiers=ep.verifiers)
    return move_to_device_pass(moved, {str(d): str(device) for d in ("meta", "cpu")})


def op_counts(ep: ExportedProgram) -> dict[str, int]:
    """Custom-op node counts, keyed like `k3::kda`."""
    c = Counter(n.target.name().split(".")[0] for n in ep.graph.nodes
                if n.op == "call_function" and hasattr(n.target, "name") and n.target.name().startswith("k3::"))
    return dict(sorted(c.items()))
