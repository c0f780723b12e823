"""TensorRT runner: `model.engine` of an export folder behind the runners' `infer(feeds) -> outputs` interface.

Needs TensorRT 11 (`tensorrt`) and a CUDA GPU of the SM the engine was built for; refuses an engine built for
another SM or TensorRT version, or a `model.engine.json` that is not a record k3x wrote (`check_engine_meta`).
The k3 plugin creators are registered with the paths recorded at build time (AOT plugins load their embedded
cubins through the CUDA driver; JIT plugins call the Triton launchers through torch). State I/O: `past.*` feeds
in, `present.*` outputs out, all on the GPU; output shapes come from the execution context once the input shapes
are set.
A serving engine (`k3x export --serving`, then build-engine) runs behind the same `infer`: serve() keeps the
state pools on `device` ("cuda"), so `_bind` hands TensorRT their addresses as they are (no copy of a pool per
step); the engine only reads them. Pools are not aliased to outputs: the step returns its new rows (O(B + N):
`new.*`, into fresh buffers) and serve() writes them into the pools in place (runtime/pools.py), as for ORT.
A weight-stripped engine (`--strip-weights`) is refitted before its context is made (runtime/engine_refit.py).
Not run in CI (no GPU and no TensorRT 11 there); the serving engine's build is (tests/plugins/test_serving_engine_rtx.py).
`enqueue` is the capturable step (no sync, the caller's stream) that `--cuda-graph` records into a CUDA graph
with the static bindings of runtime/cuda_graph.py; `infer` is the same step on the runner's own stream,
synchronised, with plugin failures reported.
"""

from __future__ import annotations

from pathlib import Path
import json

import torch
from torch import Tensor

from ..exporter.engine import ENGINE_FILE, ENGINE_META, EngineBuildError, import_trt
from .base import RunnerError


class TrtRunner:
    name = "trt"
    device = "cuda"  # where its feeds live: serve() puts the pools here, so they are bound without a copy
    torch_threads = 1  # torch's bookkeeping around it on one thread (base.torch_threads_for)

    def __init__(self, export_dir: Path, *, runtime: str = "trt") -> None:
        if not torch.cuda.is_available():
            raise RunnerError("backend 'trt' needs a CUDA GPU (torch.cuda.is_available() is False)")
        try:
            self.trt = trt = import_trt(runtime)
            major, minor = torch.cuda.get_device_capability()
            self.meta = check_engine_meta(export_dir, tensorrt_version=trt.__version__, sm=major * 10 + minor)
        except EngineBuildError as e:
            raise RunnerError(str(e)) from None
        from ..custom_ops import trt_plugins as plugins
        from ..plugins import adapter

        self._errors = adapter.ERRORS
        plugins.register_creators(trt, sm=self.meta["sm"], path=self.meta["plugin_paths"])
        self.logger = trt.Logger(trt.Logger.WARNING)
        path = Path(export_dir) / ENGINE_FILE
        self.engine = trt.Runtime(self.logger).deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise RunnerError(f"{path}: TensorRT could not deserialize the engine (see its log above)")
        if self.meta.get("stripped"):  # weight-stripped: its weights streamed in from the export (engine_refit.py)
            from .engine_refit import refit_stripped

            self.refit_seconds = refit_stripped(trt, self.engine, self.logger, Path(export_dir), self.meta["weights"])
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        mode = trt.TensorIOMode.INPUT
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == mode]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) != mode]
        self.dtypes = {n: _torch_dtype(trt, self.engine.get_tensor_dtype(n)) for n in names}
        self.stream = torch.cuda.Stream()

    def _bind(self, feeds: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(inputs as bound, fresh output buffers): shapes set and every tensor address given to the context.
        CUDA tensors of the engine's dtypes are bound as they are (no copy: a graph's static buffers)."""
        missing, extra = sorted(set(self.inputs) - set(feeds)), sorted(set(feeds) - set(self.inputs))
        if missing or extra:
            raise RunnerError(f"trt: feeds do not match the engine inputs: missing {missing}, unexpected {extra}")
        live = {}
        for n in self.inputs:
            t = feeds[n]
            if t.dtype != self.dtypes[n]:
                raise RunnerError(f"trt: input {n!r} wants {self.dtypes[n]}, got {t.dtype}")
            live[n] = t.to("cuda").contiguous()
            if not self.context.set_input_shape(n, tuple(live[n].shape)):
                raise RunnerError(f"trt: input {n!r} shape {tuple(live[n].shape)} is outside the engine's profile "
                                  f"{self.meta['input_shapes'].get(n)}")
            self.context.set_tensor_address(n, live[n].data_ptr())
        outs = {}
        for n in self.outputs:
            outs[n] = torch.empty(tuple(self.context.get_tensor_shape(n)), dtype=self.dtypes[n], device="cuda")
            self.context.set_tensor_address(n, outs[n].data_ptr())
        return live, outs

    def _execute(self, stream: int) -> None:
        if not self.context.execute_async_v3(stream):
            raise RunnerError("trt: execute_async_v3 failed (see TensorRT's log)")

    @torch.no_grad()
    def infer(self, feeds: dict[str, Tensor]) -> dict[str, Tensor]:
        live, outs = self._bind(feeds)
        self._errors.clear()
        self.stream.wait_stream(torch.cuda.current_stream())
        self._execute(self.stream.cuda_stream)
        self.stream.synchronize()
        del live
        if self._errors:
            raise RunnerError("trt: plugin failures: " + "; ".join(self._errors))
        return outs

    @torch.no_grad()
    def enqueue(self, feeds: dict[str, Tensor]) -> dict[str, Tensor]:
        """One step enqueued on the current stream with no host synchronisation: what a CUDA graph captures
        (runtime/cuda_graph.py). `feeds` must stay alive (the graph's static buffers); plugin errors of a
        replayed graph are not reported (the plugins' host-side checks ran at the warm-up and capture)."""
        _, outs = self._bind(feeds)
        self._execute(torch.cuda.current_stream().cuda_stream)
        return outs


def _torch_dtype(trt, t) -> torch.dtype:
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
             trt.int32: torch.int32, trt.int64: torch.int64, trt.bool: torch.bool, trt.int8: torch.int8}
    return table[t]


META_FIELDS = {"sm": int, "runtime": str, "tensorrt_version": str, "plugin_paths": dict, "input_shapes": dict}


def check_engine_meta(export_dir: Path, *, tensorrt_version: str, sm: int) -> dict:
    """The engine's metadata, or a refusal when it was built for another SM or TensorRT version."""
    path = Path(export_dir) / ENGINE_META
    if not path.is_file():
        raise EngineBuildError(f"{path}: missing; build the engine with `k3x build-engine {export_dir}`")
    try:
        meta = json.loads(path.read_text())
        bad = [k for k, t in META_FIELDS.items() if not isinstance(meta.get(k), t)]
    except (OSError, ValueError, AttributeError) as e:
        raise EngineBuildError(f"{path}: unreadable ({e}); rebuild the engine with `k3x build-engine`") from None
    if bad:
        raise EngineBuildError(f"{path}: field {bad[0]!r} missing or of the wrong type; rebuild the engine")
    if meta["sm"] != sm:
        raise EngineBuildError(f"{export_dir / ENGINE_FILE}: built for sm_{meta['sm']}, this GPU is sm_{sm}; "
                               "rebuild it on this machine")
    if meta["tensorrt_version"] != tensorrt_version:
        raise EngineBuildError(f"{export_dir / ENGINE_FILE}: built with {meta['runtime']} {meta['tensorrt_version']}, "
                               f"this process has {tensorrt_version}; rebuild it")
    return meta
