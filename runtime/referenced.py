"""Weights of an export that references its checkpoint (`k3x export --weights reference`), read at load.

`referenced_weights` reads the tensors of the checkpoint the manifest's `weight_source` entry names under
the names the programs use (checkpoint/reference.referenced_tensors: exactly the recorded files, each
opened once, a regular file confined to its folder, of the recorded size and sha256 unless `check_hashes`
is off, and loaded from the bytes that were checked): `None` for an export whose artifacts hold their
weights. The pt2 runner attaches them to the graph-only program
(exporter/trace.with_weights); the ORT runner hands them to ONNX Runtime as the initializers the graph points
at a file that never exists (`ort_initializers`, exporter/onnx_weights.reference_weights).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..folder.artifacts import ExportFolder
from .base import RunnerError

# ONNX element type -> numpy dtype of the same width (the bytes are handed over as they are)
_NUMPY_OF = {1: "float32", 2: "uint8", 3: "int8", 6: "int32", 7: "int64", 10: "uint16", 16: "uint16"}


def referenced_weights(folder: ExportFolder, check_hashes: bool = True) -> dict[str, torch.Tensor] | None:
    """name -> tensor of every weight the folder's artifacts read from the checkpoint; None when they hold
    their own. RunnerError (one line naming the file) for a missing, moved or changed checkpoint."""
    entry = folder.manifest.get("weight_source")
    if entry is None:
        return None
    from ..checkpoint.files import CheckpointError
    from ..checkpoint.reference import referenced_tensors

    try:
        return dict(referenced_tensors(entry, dtype=folder.dtype(), expert_format=folder.options().build.expert_format,
                                       check_hash=check_hashes))
    except (CheckpointError, OSError) as e:
        raise RunnerError(f"{folder.path}: weights referenced in the checkpoint: {e}") from None


def ort_initializers(path: Path, weights: dict[str, torch.Tensor]) -> dict:
    """name -> OrtValue for every initializer of the ONNX model at `path` whose data points at the absent
    reference file, from `weights` (RunnerError naming the model and the first one `weights` lacks)."""
    import onnx
    import onnxruntime as ort

    from ..exporter.onnx_weights import REFERENCE_LOCATION

    model = onnx.load(str(path), load_external_data=False)
    out = {}
    for init in model.graph.initializer:
        where = {e.key: e.value for e in init.external_data}.get("location")
        if init.data_location != onnx.TensorProto.EXTERNAL or where != REFERENCE_LOCATION:
            continue
        t = weights.get(init.name)
        if t is None or list(t.shape) != list(init.dims):
            raise RunnerError(f"{path}: initializer {init.name!r} {list(init.dims)}: the checkpoint gives "
                              f"{None if t is None else list(t.shape)}")
        if init.data_type not in _NUMPY_OF:
            raise RunnerError(f"{path}: initializer {init.name!r}: element type {init.data_type} is not supported")
        np = t.contiguous().view(getattr(torch, _NUMPY_OF[init.data_type])).numpy()
        out[init.name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np, init.data_type)
    return out
