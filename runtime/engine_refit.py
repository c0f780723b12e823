"""Refit a weight-stripped engine at load (TensorRT 11 `Refitter`), streaming its weights one at a time.

`k3x build-engine --strip-weights` records each refittable weight's source in `model.engine.json`
(exporter/engine_weights.py). `refit_stripped` asks the engine's Refitter which weights it needs
(`get_all_weights`), checks the whole table before a byte is read (`resolve_sources`: the table's schema,
every source confined to the export folder or the referenced checkpoint's recorded files, regular files,
ranges inside them), and for each: reads its bytes from the recorded source (16 MiB `pread`s, length and
sha256 checked: data changed after the build is refused naming the weight; an export that references its
checkpoint reads the checkpoint's byte ranges), copies them to the GPU and hands
TensorRT the device pointer (`set_named_weights(..., TensorLocation.DEVICE)`); the host buffer is dropped
before the next weight, so host memory holds one weight at a time, never the rank. TensorRT needs every
weight set before `refit_cuda_engine`, so the device copies live until the refit (the rank's weights once
more on the GPU, briefly), then are freed.

Not run in CI: TensorRT-RTX 1.7 cannot build a refittable plan without a GPU, and full TensorRT 11 is not
installable here (tests/exporter/test_reference_serving.py checks the sources the refit reads,
tests/hostile/test_refit_sources.py the checks of a crafted table).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from ..exporter.engine import ONNX_FILE
from ..exporter.engine_weights import WeightSourceError, check_sources, inline_weights, read_weight
from .base import RunnerError

TRT_DTYPES = {"FLOAT": "float32", "FLOAT16": "float16", "BFLOAT16": "bfloat16", "UINT8": "uint8", "INT8": "int8",
              "INT32": "int32", "INT64": "int64", "BOOL": "bool"}  # ONNX TensorProto name -> trt.DataType attr


def refit_stripped(trt, engine, logger, export_dir: Path, sources: dict[str, dict]) -> float:
    """Refit `engine` from `sources` (the build's `weights` table); seconds taken. RunnerError naming the weight
    that has no source, a changed source, or a size TensorRT does not expect."""
    t0 = time.perf_counter()
    checkpoint = resolve_sources(export_dir, sources)
    refitter = trt.Refitter(engine, logger)
    names = list(refitter.get_all_weights())
    unknown = sorted(set(names) - set(sources))
    if unknown:
        raise RunnerError(f"{Path(export_dir) / 'model.engine.json'}: no source for refittable weight(s) {unknown[:5]}")
    inline = inline_weights(Path(export_dir) / ONNX_FILE) if any(sources[n].get("inline") for n in names) else {}
    on_device = []  # kept until refit_cuda_engine: TensorRT reads the pointers then
    for name in names:
        src = sources[name]
        try:
            raw = read_weight(export_dir, name, src, inline, checkpoint)
        except WeightSourceError as e:
            raise RunnerError(str(e)) from None
        dev = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy()).to("cuda")
        del raw
        dtype = getattr(trt, TRT_DTYPES[src["dtype"]])
        count = int(np.prod(src["shape"], dtype=np.int64))
        proto = refitter.get_weights_prototype(name)
        if proto.size != count:
            raise RunnerError(f"{export_dir}: weight {name!r} has {count} elements, the engine wants {proto.size}")
        refitter.set_named_weights(name, trt.Weights(dtype, dev.data_ptr(), count), trt.TensorLocation.DEVICE)
        on_device.append(dev)
    stream = torch.cuda.current_stream()
    if not refitter.refit_cuda_engine_async(stream.cuda_stream):
        raise RunnerError(f"{export_dir}: TensorRT refused the refit (missing: {list(refitter.get_missing_weights())[:5]})")
    stream.synchronize()
    del on_device
    return time.perf_counter() - t0


def resolve_sources(export_dir: Path, sources: object) -> Path | None:
    """The checkpoint folder the table's checkpoint ranges read (None when it has none), once the table
    (`model.engine.json`'s `weights`) is checked (exporter/engine_weights.check_sources): file sources inside
    the export folder, ranges in the files the referenced checkpoint recorded, regular files, every range
    inside its file. RunnerError (one line naming the weight and field) otherwise; nothing is read."""
    from ..checkpoint.files import CheckpointError, checkpoint_file
    from ..checkpoint.reference import referenced_checkpoint
    from ..folder.artifacts import ExportFolder, ManifestError

    ranged = isinstance(sources, dict) and any(isinstance(s, dict) and s.get("checkpoint") for s in sources.values())
    folder, recorded = None, {}
    try:
        if ranged:  # every recorded file present, confined and of its size (each range's sha256 is checked as read)
            entry = ExportFolder.open(export_dir).manifest.get("weight_source")
            folder = referenced_checkpoint(entry, check_hash=False)
            recorded = {f["name"]: checkpoint_file(folder, f["name"]) for f in entry["files"]}
        check_sources(sources, Path(export_dir), recorded)
    except (CheckpointError, ManifestError) as e:
        raise RunnerError(f"{export_dir}: weights referenced in the checkpoint: {e}") from None
    except WeightSourceError as e:
        raise RunnerError(str(e)) from None
    return folder
