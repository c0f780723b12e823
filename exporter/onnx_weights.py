"""Weights streamed into an ONNX export: tensor by tensor from the checkpoint into `model.onnx.data`.

The program is traced on the meta device (no weights in memory) and exported weightless, so every weight is a
graph input; `attach_streamed_weights` then takes the checkpoint's entries one at a time
(`checkpoint.byte_ranges.stream_weights`: stacked experts as the model holds them, MXFP4 experts packed),
appends each to the external data file (4 KiB-aligned from 1 MiB, so ONNX Runtime can map it; 64 B below)
and turns its graph input back into an initializer that points there. An entry whose bytes are the
checkpoint's (`StoredTensor`: bf16 -> bf16, packed MXFP4) is copied file to file (`copy_file_range`), seen
only in 16 MiB `pread` chunks by the sha256 the manifest records; a converted one is written from memory.
Peak memory is one converted tensor (or a few chunks) plus the graph; both flavor files reference the one
data file.

`reference_weights` (`k3x export --weights reference`) writes no data at all: each weight input becomes an
initializer whose external data points at `REFERENCE_LOCATION`, a file that never exists; the ORT runner
supplies every such initializer from the checkpoint (`SessionOptions.add_external_initializers`), so ONNX
Runtime never opens it and optimises the graph exactly as a copying export's.
"""

from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path
from typing import Iterable

import onnx_ir as ir
import torch

from ..checkpoint.byte_ranges import StoredTensor, WriteLog, copy_ranges, require_all, wrong_entry

ALIGN, SMALL_ALIGN, SMALL = 4096, 64, 1 << 20  # tensors under 1 MiB: 64-byte alignment (no page padding)


IR_DTYPE = {torch.float32: ir.DataType.FLOAT, torch.bfloat16: ir.DataType.BFLOAT16,
            torch.float16: ir.DataType.FLOAT16, torch.uint8: ir.DataType.UINT8}


def attach_streamed_weights(model: ir.Model, out_dir: Path, data_name: str,
                            tensors: Iterable[tuple[str, torch.Tensor | StoredTensor]], weight_names: set[str]
                            ) -> tuple[Path, str]:
    """Write every tensor that a weight input of `model` names into `out_dir / data_name`; each such input
    becomes an external initializer. Returns the data file and its sha256, taken as it is written (copied
    bytes are seen in `pread` chunks just before the copy). ValueError naming the tensor on a dtype/shape
    mismatch, or naming the weight inputs the stream did not provide."""
    g = model.graph
    inputs = {v.name: v for v in g.inputs}
    path = Path(out_dir) / data_name
    filled: list[ir.Value] = []
    log, start, sha = WriteLog(), time.perf_counter(), hashlib.sha256()
    with open(path, "wb") as f:
        for name, t in tensors:
            v = inputs.get(name)
            if v is None:
                continue  # a state_dict entry the graph does not read
            if v.dtype != IR_DTYPE.get(t.dtype) or list(v.shape) != list(t.shape):
                raise wrong_entry(name, t, f"the graph wants {v.dtype} {list(v.shape)}")
            align = ALIGN if t.nbytes >= SMALL else SMALL_ALIGN
            pad = -f.tell() % align
            f.write(bytes(pad))
            sha.update(bytes(pad))
            offset = f.tell()
            if isinstance(t, StoredTensor):
                copy_ranges(t.ranges, f, see=(sha.update,))
                log.copied += t.nbytes
            else:
                data = memoryview(t.contiguous().view(torch.uint8).numpy())
                f.write(data)
                sha.update(data)
                log.converted += t.nbytes
            v.const_value = ir.ExternalTensor(data_name, offset, t.nbytes, v.dtype, shape=v.shape, name=name,
                                              base_dir=out_dir)
            filled.append(v)
            del t
    log.seconds = time.perf_counter() - start
    log.report(data_name)
    require_all((set(inputs) & weight_names) - {v.name for v in filled})
    for v in filled:
        g.inputs.remove(v)
        g.register_initializer(v)
    return path, sha.hexdigest()


REFERENCE_LOCATION = "weights-in-checkpoint.absent"  # never written; the runner supplies these initializers


def reference_weights(model: ir.Model, weight_names: set[str]) -> None:
    """Every weight input of `model` becomes an initializer that points at `REFERENCE_LOCATION` (name, dtype and
    shape kept), for the loader to supply from the checkpoint."""
    g = model.graph
    values = [v for v in g.inputs if v.name in weight_names]
    for v in values:
        size = v.dtype.itemsize * math.prod(v.shape.numpy())
        v.const_value = ir.ExternalTensor(REFERENCE_LOCATION, 0, size, v.dtype, shape=v.shape, name=v.name)
        g.inputs.remove(v)
        g.register_initializer(v)
