"""ONNX Runtime runner: an `.onnx` file behind the runners' `infer(feeds) -> outputs` interface.

Notable choices:
- Providers are explicit: `auto` creates a CUDA session and keeps CUDA only if `sess.get_providers()`
  really lists it (else the session is CPU), and says which; `cuda` fails if CUDA does not initialise.
- Every call goes through IO binding with pre-allocated outputs whose shapes come from the graph's dim
  names (`batch`, `seq`, `past_seq`, `total_seq`); bindings are kept between calls and a port is bound again
  only when its tensor changed (`_bound`). On CUDA (with a CUDA torch) the state stays on the
  device between steps: feeds that are CUDA tensors are bound by pointer and outputs are written in
  place into CUDA tensors, which the next step feeds back as `past.*`. On CPU the same code binds host
  memory — which is how the binding logic is tested on machines without a GPU.
- Sessions run without ONNX Runtime's CPU memory arena and memory-pattern planning: with them, RSS grew
  over a long decode (the cache grows every step, so each step's shapes are new and the arena keeps
  every size it has seen). k3-mini, CPU, onnxruntime-gpu 1.31, RSS after 1k / 2k / 3k decode steps:
  with the arena 272 / 281 / 291 MB, without 264 / 263 / 265 MB; step time unchanged within noise.
  Shrinking the arena after every run (`memory.enable_memory_arena_shrinkage`) keeps RSS flat, but the
  k3-bench 32-sequence decode step then took 109 ms [92-115] against 94 [93-107] without the arena.
- After a session is built, memory the load freed is handed back to the OS, and a CPU session's weights are
  moved onto 2 MB pages (runtime/host_memory.py: k3-bench int8-trunk decode 10.5 -> 8.6 ms/token).
- CPU sessions load the k3 ops' compiled CPU kernels when they are built (`k3x build-ort-kernels`,
  runtime/ort_kernels.py): ONNX Runtime then runs those k3 nodes on them instead of their function bodies.
- onnxruntime is imported when a runner is built; missing, it is a RunnerError naming the package.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path

import torch
from torch import Tensor

from .base import Feeds, RunnerError
from .host_memory import release_freed_heap, resident_bytes, weights_on_huge_pages
from .ort_kernels import library

# ORT type string -> (ONNX TensorProto element type, torch dtype). Binding by the ONNX element type (an int)
# rather than a numpy dtype is what lets bf16 tensors be bound: numpy has no bfloat16.
_ORT_TYPES: dict[str, tuple[int, torch.dtype]] = {
    "tensor(float)": (1, torch.float32),
    "tensor(float16)": (10, torch.float16),
    "tensor(bfloat16)": (16, torch.bfloat16),
    "tensor(int64)": (7, torch.int64),
    "tensor(int32)": (6, torch.int32),
}


def import_onnxruntime():
    try:
        import onnxruntime
    except ImportError as e:
        raise RunnerError(f"onnxruntime is not installed ({e}); pip install onnxruntime-gpu (or onnxruntime)") from None
    return onnxruntime


def ort_session(path: Path, provider: str = "auto", intra_op_threads: int = 0, collectives: bool = False,
                profile: str | None = None, initializers: dict | None = None):
    """An InferenceSession on the requested provider; returns (session, provider actually used).
    `collectives`: the model has a rank program's collective nodes (runtime/ort_collectives.py); `profile`: a
    file prefix for ONNX Runtime's per-node profile (written by `session.end_profiling()`); `initializers`:
    name -> OrtValue for initializers whose data is not in the export (runtime/referenced.py)."""
    ort = import_onnxruntime()
    if provider not in ("auto", "cuda", "cpu"):
        raise RunnerError(f"provider={provider!r}: choose auto, cuda or cpu")
    if not Path(path).is_file():
        raise RunnerError(f"{path}: no such ONNX model file")
    so = ort.SessionOptions()
    so.enable_cpu_mem_arena = False  # RSS stays flat over long decodes (module docstring)
    so.enable_mem_pattern = False
    if intra_op_threads:
        so.intra_op_num_threads = intra_op_threads
    if profile:
        so.enable_profiling, so.profile_file_prefix = True, profile
    if initializers:
        so.add_external_initializers(list(initializers), list(initializers.values()))
    if collectives:
        try:
            from .ort_collectives import register
        except ImportError as e:
            raise RunnerError(f"{path}: its collective nodes need onnxruntime-extensions ({e}); "
                              "pip install --no-deps onnxruntime-extensions==0.15.2") from None
        register(so)
    want_cuda = provider != "cpu" and "CUDAExecutionProvider" in ort.get_available_providers() and \
        (provider == "cuda" or _cuda_device_present())
    providers = (["CUDAExecutionProvider"] if want_cuda else []) + ["CPUExecutionProvider"]
    kernels = None if want_cuda else library()  # fp32 host kernels of k3 ops, when built (ort_kernels.py)
    if kernels is not None:
        so.register_custom_ops_library(str(kernels))
    if provider == "auto":  # a failed CUDA probe is expected on CPU machines; we report the outcome ourselves
        ort.set_default_logger_severity(4)
    release_freed_heap()
    before = resident_bytes()  # what the load adds is what weights_on_huge_pages weighs
    try:
        sess = ort.InferenceSession(str(path), so, providers=providers)
    except Exception as e:  # noqa: BLE001 - ORT raises its own types; name the file
        hint = ""
        bf16 = "Could not find an implementation" in str(e) or "tensor(bfloat16)" in str(e)  # no kernel / library
        if bf16 and not want_cuda:
            hint = (" (ONNX Runtime's CPU provider lacks kernels for this graph's dtype: bf16 graphs need the CUDA "
                    "provider; export with --trunk bf16 or --dtype fp32 to run on CPU)")
        raise RunnerError(f"{path}: ONNX Runtime cannot load it: {e}{hint}") from None
    finally:
        ort.set_default_logger_severity(2)
    if collectives:
        from .ort_collectives import check_ready

        reason = check_ready(path)
        if reason:
            raise RunnerError(f"{path}: {reason}")
    release_freed_heap()
    used = "cuda" if "CUDAExecutionProvider" in sess.get_providers() else "cpu"
    if used == "cpu":
        weights_on_huge_pages(resident_bytes() - before)
    if provider == "cuda" and used != "cuda":
        raise RunnerError("provider=cuda: CUDAExecutionProvider did not initialise (no GPU, CUDA 13 / cuDNN 9 "
                          "libraries missing, or onnxruntime without CUDA); use --provider cpu or auto")
    return sess, used


def _cuda_device_present() -> bool:
    """Whether the CUDA driver sees a device (Linux: libcuda's cuInit and cuDeviceGetCount; elsewhere assumed).
    onnxruntime-gpu lists CUDAExecutionProvider on any machine: without this, `auto` on a CPU machine built a
    CUDA session that fell back to the CPU, without the CPU kernels a CPU session loads."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return True
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def known_dims(feeds: Feeds) -> dict[str, int]:
    """The graph's dim names sized by the feeds (the batch interface's batch / seq / past_seq / total_seq, or a
    serving step's tokens / seqs / logits_rows: exporter/serving.py)."""
    if "cu_seqlens" in feeds:
        return {"tokens": feeds["input_ids"].shape[0], "seqs": feeds["past_lens"].shape[0],
                "logits_rows": feeds["logits_index"].shape[0]}
    known = {"batch": feeds["input_ids"].shape[0], "seq": feeds["input_ids"].shape[1]}
    past = next((t.shape[1] for n, t in feeds.items() if n.startswith("past_key_values.")), 0)
    return known | {"past_seq": past, "total_seq": past + known["seq"]}


def output_shapes(dims: dict[str, list], known: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Concrete output shapes from the graph's dim names and their sizes (`known_dims`)."""
    out = {}
    for name, shape in dims.items():
        bad = [d for d in shape if not isinstance(d, int) and d not in known]
        if bad:
            raise RunnerError(f"output {name!r}: cannot size dim(s) {bad} (known: {sorted(known)})")
        out[name] = tuple(d if isinstance(d, int) else known[d] for d in shape)
    return out


class OrtRunner:
    """ONNX Runtime through IO binding; state tensors stay on the session's device between steps."""

    name = "ort"
    binds_outputs = True  # infer(feeds, out=...) writes into the caller's tensors (runtime/step_outputs.py)
    torch_threads = 1  # torch's bookkeeping around it on one thread (base.torch_threads_for)

    def __init__(self, path: Path, *, provider: str = "auto", intra_op_threads: int = 0,
                 collectives: bool = False, profile: str | None = None,
                 weights: dict[str, Tensor] | None = None) -> None:
        self.path = Path(path)
        # weights: those the graph references in the checkpoint (runtime/referenced.py); kept alive with the session
        self.initializers = None
        if weights is not None:
            from .referenced import ort_initializers

            self.initializers = ort_initializers(self.path, weights)
        self.session, self.provider = ort_session(self.path, provider, intra_op_threads, collectives, profile,
                                                  self.initializers)
        self.device = torch.device("cuda" if self.provider == "cuda" and torch.cuda.is_available() else "cpu")
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.outputs = {o.name: o for o in self.session.get_outputs()}
        for v in list(self.inputs.values()) + list(self.outputs.values()):
            if v.type not in _ORT_TYPES:
                raise RunnerError(f"{self.path}: tensor {v.name!r} has type {v.type}, which this runner does not bind")
        self.dims = {n: list(o.shape) for n, o in self.outputs.items()}
        # name -> (ONNX element type, torch dtype, shape), read once: each NodeArg property read is a call into
        # ONNX Runtime's binding (an int8 k3-bench decode step's 44 ports: ~0.1 ms a call)
        self._ports = {n: (*_ORT_TYPES[v.type], list(v.shape))
                       for n, v in [*self.inputs.items(), *self.outputs.items()]}
        self._shapes: dict[tuple, dict[str, tuple[int, ...]]] = {}  # known_dims' sizes -> output_shapes
        self._idle: list[tuple[object, dict]] = []  # IO bindings between calls, each with what it holds (`_bound`)
        self._lock = threading.Lock()

    def _bind(self, binding, name: str, t: Tensor, output: bool = False) -> None:
        device = "cuda" if t.is_cuda else "cpu"
        args = (name, device, t.device.index or 0, self._ports[name][0], list(t.shape), t.data_ptr())
        (binding.bind_output if output else binding.bind_input)(*args)

    def _bound(self, ports: dict[tuple[str, bool], Tensor]):
        """An IO binding holding `ports` ((name, is output) -> tensor), and its record. A binding is kept between
        calls with, per port, the tensor it holds (a weak reference: it keeps no state alive), its address and
        shape; a port is bound again only when its tensor is another one, or moved or reshaped (ONNX Runtime
        replaces a name's binding). A decode loop whose states alternate between two sets of tensors
        (runners.py `DecodeSteps`) keeps two bindings, and each step takes the one holding the first state output
        it was given (one of the first eight outputs). Each bind is a call into ONNX Runtime, slow with the
        caches cold after a step's weights went through them: in such a loop a k3-bench int8-trunk decode step binds
        8 of its 44 ports (the token, the growing latent caches, the logits). Taken out of the idle list for the call,
        so a call on another thread gets a binding of its own."""
        probes = [p for p in ports if p[1]][:8]  # outputs: a state a decode loop gives is one of them
        with self._lock:
            idle = self._idle
            hits = (i for p in probes for i, (_, held) in enumerate(idle) if p in held and held[p][0]() is ports[p])
            pick = next(hits, 0 if len(idle) == 2 else None)
            binding, held = idle.pop(pick) if pick is not None else (self.session.io_binding(), {})
        for port, t in ports.items():
            had = held.get(port)
            if had is None or had[0]() is not t or had[1] != t.data_ptr() or had[2] != t.shape:
                held.pop(port, None)  # a failed bind leaves the port unrecorded, never recorded wrongly
                self._bind(binding, port[0], t, output=port[1])
                held[port] = (weakref.ref(t), t.data_ptr(), t.shape)
        return binding, held

    def check_feeds(self, feeds: Feeds) -> None:
        missing, extra = sorted(set(self.inputs) - set(feeds)), sorted(set(feeds) - set(self.inputs))
        if missing or extra:
            def few(names: list[str]) -> str:
                return str(names[:6])[:-1] + (f", ... {len(names)} in all]" if len(names) > 6 else "]")

            raise RunnerError(f"{self.path}: feeds do not match the model inputs: missing {few(missing)}, "
                              f"unexpected {few(extra)}")
        for name, t in feeds.items():
            _, want, shape = self._ports[name]
            if t.dtype != want or t.dim() != len(shape) or any(
                    isinstance(d, int) and d != s for d, s in zip(shape, t.shape)):
                raise RunnerError(f"{self.path}: input {name!r} wants {want} {shape}, got {t.dtype} {list(t.shape)}")

    def infer(self, feeds: Feeds, out: Feeds | None = None) -> Feeds:
        """Outputs by name; `out`: tensors to write named outputs into (each used when its shape, dtype and
        device are the output's and it is contiguous; otherwise the output gets a new tensor)."""
        self.check_feeds(feeds)
        live = {n: t.to(self.device).contiguous() for n, t in feeds.items()}  # no copy when already there
        outs = {}
        known = known_dims(feeds)
        key = tuple(known.values())
        if key not in self._shapes:  # a decode loop's steps differ in past_seq only: one entry a step's length
            if len(self._shapes) >= 64:
                self._shapes.clear()
            self._shapes[key] = output_shapes(self.dims, known)
        for n, s in self._shapes[key].items():
            dtype, given = self._ports[n][1], (out or {}).get(n)
            fits = given is not None and tuple(given.shape) == s and given.dtype == dtype and \
                given.device == self.device and given.is_contiguous()
            outs[n] = given if fits else torch.empty(s, dtype=dtype, device=self.device)
        binding, held = self._bound({**{(n, False): t for n, t in live.items()},
                                     **{(n, True): t for n, t in outs.items()}})
        try:
            binding.synchronize_inputs()
            self.session.run_with_iobinding(binding)
            binding.synchronize_outputs()
        finally:
            with self._lock:
                if len(self._idle) < 2:  # (a third, from a call on another thread, is dropped)
                    self._idle.append((binding, held))
        return outs
