"""Stage: `trt`-flavour ONNX -> serialized TensorRT engine (`model.engine`) with the k3 plugins.

- Runtimes: "trt" (TensorRT 11, package `tensorrt`, needs the GPU it builds for) and "trt-rtx"
  (TensorRT-RTX 1.7 from PyPI, builds on a CPU-only machine; targets SM75/80/86/89/120/121, not SM90): the
  targets and the GPUs each serves are exporter/engine_targets.py, checked when the options are made.
- Optimisation profile: one, derived from the export's recorded dynamic dims (every input dim named batch /
  seq / past_seq gets that dim's min/opt/max; a serving export's are its `serving.dims`: tokens, seqs
  (`seqs + 1` for cu_seqlens), table_blocks, logits_rows, slots, blocks; the block size is static).
  `EngineOptions.dims` (`--min/--opt/--max`) overrides single values, which must stay within the exported
  range: a profile past it corrupted TensorRT's heap. The maxima size TensorRT's activation memory. Static dims stay.
- Precision: TensorRT 11 networks are strongly typed, so the precision plan is the ONNX graph's own dtypes;
  no builder precision flags are set.
- Plugins: IPluginV3 creators (custom_ops/trt_plugins.py), one path per plugin (AOT cubins for `sm`, or JIT), printed
  and recorded. A timing cache file lives next to the engine, listed in the `trt` artifact, and is reused
  only while its recorded sha256 matches.
- Input: the manifest's `onnx` artifact, every file checked (inside the folder, size, sha256) before the
  parser opens `model.trt.onnx`, so a tampered or symlinked ONNX is refused instead of becoming a "clean"
  engine; its recorded sha256 is what `model.engine.json` names. A file the manifest does not list is
  never overwritten (`artifacts.refuse_unlisted`): a user's own `model.engine` makes the build refuse.
- TensorRT-RTX's ONNX parser dlopens the unversioned `libtensorrt_rtx.so`, which the pip wheel does not
  ship, and the loader reads LD_LIBRARY_PATH only at process start. `ensure_rtx_library_path` makes the
  symlinks (in `<venv>/trt-rtx-lib`, as scripts/setup_trt_rtx.sh) and, when that folder is not on
  LD_LIBRARY_PATH, re-executes the `k3x build-engine` process once with it; anywhere else (a library
  call) it is one clear error instead of the parser's `terminate` (exit 134).
- `--strip-weights`: a weight-stripped plan whose metadata names each weight's source (exporter/engine_weights.py;
  refitted at load: runtime/engine_refit.py). TensorRT-RTX needs a GPU for it (Myelin); the error says so.
- `--runtime auto` (default): TensorRT 11 when `tensorrt` is importable and a CUDA GPU is visible (it
  builds for the GPU it runs on), else TensorRT-RTX.
- Output: `model.engine`, `model.engine.json` (TensorRT version, runtime, SM, plugin paths, profile, ONNX
  hash) and `timing.cache` renamed into place together (replacing an earlier build's: `EngineArtifact.replaced`)
  and recorded as the manifest's `trt` artifact; the runner refuses an engine whose SM or TensorRT version differs.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..folder.artifacts import ExportFolder, ManifestError, refuse_unlisted, write_artifact
from ..folder.dims import DYNAMIC_DIMS, DimRange
from .engine_targets import DEFAULT_SM, RUNTIMES, check_target
from .engine_weights import checkpoint_ranges, parse_onnx, strip_plan

log = logging.getLogger("k3x.plugins")
ENGINE_FILE, ENGINE_META, TIMING_CACHE, ONNX_FILE = "model.engine", "model.engine.json", "timing.cache", "model.trt.onnx"


class EngineBuildError(RuntimeError):
    """TensorRT missing, the ONNX not parseable or the build failed; the message names node and cause."""


@dataclass(frozen=True)
class EngineOptions:
    runtime: str = "auto"  # resolved in __post_init__ (resolve_runtime)
    sm: int | None = None  # None: 90 for trt, 89 for trt-rtx
    plugin_path: str = "aot"  # aot | jit (per plugin, where it has that path)
    dims: dict[str, dict[str, int]] = field(default_factory=dict)  # {"batch": {"max": 8}} overrides
    workspace_mib: int = 4096
    timing_cache: bool = True
    strip_weights: bool = False  # STRIP_PLAN + REFIT_IDENTICAL; sources recorded (exporter/engine_weights.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "runtime", resolve_runtime(self.runtime))
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime={self.runtime!r}: choose from {sorted(RUNTIMES)}")
        if self.plugin_path not in ("aot", "jit"):
            raise ValueError(f"plugin_path={self.plugin_path!r}: choose 'aot' or 'jit'")
        check_target(self.runtime, self.target_sm)  # an sm the runtime cannot build: refused before any work

    @property
    def target_sm(self) -> int:
        return self.sm if self.sm is not None else DEFAULT_SM[self.runtime]


@dataclass(frozen=True)
class EngineArtifact:
    path: Path
    meta: dict
    replaced: tuple[str, ...] = ()  # the earlier build's files this one replaced


def resolve_runtime(runtime: str) -> str:
    """`auto` -> "trt" when TensorRT 11 can build here (package importable and a CUDA GPU), else "trt-rtx"."""
    if runtime != "auto":
        return runtime
    import importlib.util

    if importlib.util.find_spec("tensorrt") is not None:
        import torch

        if torch.cuda.is_available():
            return "trt"
    return "trt-rtx"


_REEXEC = "K3X_RTX_LIBRARY_PATH_SET"


def ensure_rtx_library_path() -> None:
    """Make `libtensorrt_rtx.so` loadable (module docstring): symlinks, then LD_LIBRARY_PATH by re-exec."""
    import importlib.util
    import sys

    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec is None or spec.origin is None:
        return  # import_trt names the packages to install
    libs = Path(spec.origin).parent
    link_dir = Path(sys.prefix) / "trt-rtx-lib"
    try:
        link_dir.mkdir(exist_ok=True)
        for name in ("libtensorrt_rtx.so", "libtensorrt_onnxparser_rtx.so"):
            link = link_dir / name
            if not (link.is_symlink() and os.readlink(link) == str(libs / f"{name}.1")):
                tmp = link_dir / f".{name}.{os.getpid()}"
                tmp.unlink(missing_ok=True)
                os.symlink(libs / f"{name}.1", tmp)
                os.replace(tmp, link)
    except OSError as e:
        raise EngineBuildError(f"{link_dir}: cannot create the TensorRT-RTX library links ({e}); run "
                               "scripts/setup_trt_rtx.sh and export the LD_LIBRARY_PATH it prints") from None
    path = os.environ.get("LD_LIBRARY_PATH", "")
    if str(link_dir) in path.split(":"):
        return
    if os.environ.get(_REEXEC) or "build-engine" not in sys.orig_argv:
        raise EngineBuildError(f"TensorRT-RTX needs LD_LIBRARY_PATH to include {link_dir} when the process starts; "
                               f'export LD_LIBRARY_PATH="{link_dir}:$LD_LIBRARY_PATH"')
    os.environ["LD_LIBRARY_PATH"] = f"{link_dir}:{path}" if path else str(link_dir)
    os.environ[_REEXEC] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def import_trt(runtime: str):
    """The TensorRT module for `runtime`, or an error naming the packages to install."""
    names, packages = RUNTIMES[runtime]
    if runtime == "trt-rtx":
        ensure_rtx_library_path()
    for name in names:
        try:
            return __import__(name)
        except ImportError as e:
            err = e
    raise EngineBuildError(f"runtime={runtime!r}: cannot import {' or '.join(names)} ({err}); install {packages}")


_PROFILE_SPEC = re.compile(r"([a-z_]+)=([0-9]{1,10})", re.ASCII)


def parse_profile(flags: dict[str, list[str]]) -> dict[str, dict[str, int]]:
    """`{"max": ["batch=8"], ...}` (the --min/--opt/--max flags) -> `{"batch": {"max": 8}}`; ValueError naming
    the flag (ASCII digits only: `batch=²` passes str.isdigit but not int())."""
    dims: dict[str, dict[str, int]] = {}
    for key, items in flags.items():
        for item in items:
            m = _PROFILE_SPEC.fullmatch(item)
            if m is None:
                raise ValueError(f"--{key} {item[:80]!r}: expected NAME=INT, e.g. batch=8")
            dims.setdefault(m[1], {})[key] = int(m[2])
    return dims


def profile_ranges(overrides: dict[str, dict[str, int]],
                   exported: dict[str, dict[str, int]] | None = None) -> dict[str, DimRange]:
    """The export's dynamic dims (`exported`: `exported_dims(manifest)`; default DYNAMIC_DIMS) with
    per-dim overrides, checked min <= opt <= max and within what the export was traced for."""
    unknown = sorted(set(overrides) - set(exported or DYNAMIC_DIMS))
    if unknown:
        raise ValueError(f"dims {unknown}: not dynamic dims; known: {sorted(exported or DYNAMIC_DIMS)}")
    # a serving export written before its dims carried opt: tune at min
    base = ({n: DimRange(n, r["min"], r.get("opt", r["min"]), r["max"]) for n, r in exported.items()}
            if exported else DYNAMIC_DIMS)
    out = {}
    for name, traced in base.items():
        r = replace(traced, **overrides.get(name, {}))
        if not r.min <= r.opt <= r.max:
            raise ValueError(f"dim {name!r}: need min <= opt <= max, got {r.min}/{r.opt}/{r.max}")
        if r.min < traced.min or r.max > traced.max:
            raise ValueError(f"dim {name!r}: profile {r.min}..{r.max} leaves the exported range "
                             f"{traced.min}..{traced.max}")
        out[name] = r
    return out


def _logger(trt):
    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.messages: list[tuple[str, str]] = []

        def log(self, severity, msg):
            self.messages.append((severity.name, msg))
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                log.error("TensorRT: %s", msg)
            elif severity == trt.ILogger.Severity.WARNING:
                log.debug("TensorRT: %s", msg)

        def excerpt(self, n: int = 12) -> str:
            errs = [m for s, m in self.messages if s in ("ERROR", "INTERNAL_ERROR")]
            return "\n".join(("  " + m) for m in (errs or [m for _, m in self.messages])[-n:])

    return Logger()


def exported_dims(manifest: dict) -> dict[str, dict[str, int]]:
    """The dynamic dims the export was traced with: the serving step's (`serving.dims`: tokens, seqs,
    table_blocks, logits_rows, slots, blocks; the block size is fixed) or the model's (`dynamic_dims`)."""
    serving = manifest.get("serving")
    return serving["dims"] if isinstance(serving, dict) else manifest["dynamic_dims"]


_OFFSET_DIM = re.compile(r"([a-z_]+) \+ ([0-9]{1,6})", re.ASCII)


def _dim_range(name: str, ranges: dict[str, DimRange]) -> tuple[int, int, int] | None:
    """(min, opt, max) of a named ONNX dim: a dynamic dim, or one plus a constant (`seqs + 1`: cu_seqlens)."""
    m = _OFFSET_DIM.fullmatch(name or "")
    base, k = (m[1], int(m[2])) if m else (name, 0)
    r = ranges.get(base)
    return None if r is None else (r.min + k, r.opt + k, r.max + k)


def _profile(trt, builder, network, ranges: dict[str, DimRange]) -> tuple:
    prof, table = builder.create_optimization_profile(), {}
    for i in range(network.num_inputs):
        t = network.get_input(i)
        shape = list(t.shape)
        lo, opt, hi = list(shape), list(shape), list(shape)
        for j, d in enumerate(shape):
            if d >= 0:
                continue
            name = t.get_dimension_name(j)
            r = _dim_range(name, ranges)
            if r is None:
                raise EngineBuildError(f"input {t.name!r} dim {j} is dynamic with name {name!r}, which has no "
                                       f"range; known: {sorted(ranges)}")
            lo[j], opt[j], hi[j] = r
        prof.set_shape(t.name, lo, opt, hi)
        table[t.name] = [lo, opt, hi]
    return prof, table


def _set_target(trt, config, options: EngineOptions) -> None:
    sm = options.target_sm
    if options.runtime == "trt-rtx":
        cc = getattr(trt.ComputeCapability, f"SM{sm}", None)
        if cc is None:
            raise EngineBuildError(f"sm={sm}: TensorRT-RTX cannot target it; choose from "
                                   f"{[n[2:] for n in trt.ComputeCapability.__members__ if n.startswith('SM')]}")
        config.num_compute_capabilities = 1
        config.set_compute_capability(cc, 0)
        return
    import torch

    have = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    if have is None or have[0] * 10 + have[1] != sm:
        raise EngineBuildError(f"sm={sm}: TensorRT 11 builds for the GPU it runs on, found {have}; "
                               "build on a GPU of the target SM")


def build_engine(export_dir: Path, options: EngineOptions = EngineOptions()) -> EngineArtifact:
    """Build `model.engine` in `export_dir` from its `model.trt.onnx`, holding the folder's writer lock (no
    export replaces the folder mid-build, no two builds mix) and sweeping what a killed build left."""
    import shutil

    from ..folder.staging import folder_lock

    export_dir = Path(export_dir)
    if export_dir.is_dir() and not os.access(export_dir, os.W_OK):  # refuse before a build of minutes
        raise EngineBuildError(f"{export_dir}: read-only; build-engine writes {ENGINE_FILE} and {ENGINE_META} there")
    with folder_lock(export_dir):
        for leftover in export_dir.glob(".tmp-trt-*"):  # write_artifact's staging folder of a killed build
            shutil.rmtree(leftover, ignore_errors=True)
        return _build_engine(export_dir, options)


def _open(export_dir: Path) -> ExportFolder:
    """The folder (it must come from `k3x export`), its manifest read once for the whole build."""
    try:
        return ExportFolder.open(export_dir)
    except ManifestError as e:
        raise EngineBuildError(str(e)) from None


def _checked_input(folder: ExportFolder) -> tuple[Path, str, bytes]:
    """(model.trt.onnx, its recorded sha256, the reusable timing cache or b"") once every file of the `onnx`
    artifact matches the manifest and no file the build writes would overwrite a user's (module docstring)."""
    export_dir = folder.path
    try:
        files = {p.name: p for p in folder.checked_files("onnx")}
        if ONNX_FILE not in files:
            raise EngineBuildError(f"{export_dir / ONNX_FILE}: not a file of the onnx artifact; run `k3x export` "
                                   "with the trt flavour first (a --trunk bf16 / int8 export has none: --trunk dense)")
        digest = next(f["sha256"] for f in folder.manifest["artifacts"]["onnx"]["files"] if f["path"] == ONNX_FILE)
        refuse_unlisted(export_dir, [ENGINE_FILE, ENGINE_META, TIMING_CACHE])
    except ManifestError as e:
        raise EngineBuildError(str(e)) from None
    try:  # the last build's cache, only while it is what the manifest recorded
        cache = {p.name: p for p in folder.checked_files("trt")}.get(TIMING_CACHE)
    except ManifestError:
        cache = None
    return files[ONNX_FILE], digest, cache.read_bytes() if cache is not None else b""


def _build_engine(export_dir: Path, options: EngineOptions) -> EngineArtifact:
    folder = _open(export_dir)
    onnx_path, onnx_sha256, cache_bytes = _checked_input(folder)
    checkpoint = checkpoint_ranges(folder)  # --weights reference: the checkpoint (checked once), its byte ranges
    ranges = profile_ranges(options.dims, exported_dims(folder.manifest))
    trt = import_trt(options.runtime)
    from ..custom_ops import trt_plugins as plugins

    sm = options.target_sm
    paths = plugins.register_creators(trt, sm=sm, path=options.plugin_path)
    specs = plugins.specs()
    for name, p in paths.items():
        log.info("plugin k3::%s: %s path%s — %s", name, p.upper(), f" (sm_{sm} cubins)" if p == "aot" else "",
                 specs[name].notes)
    logger = _logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    t0 = time.perf_counter()
    parsed, _keep = parse_onnx(parser, onnx_path, folder, checkpoint)  # _keep: weights handed to the parser
    if not parsed:
        errs = [parser.get_error(i) for i in range(parser.num_errors)]
        lines = [f"  node {e.node()} ({e.node_name()}, {e.node_operator()}): {e.desc()}" for e in errs]
        raise EngineBuildError(f"{onnx_path}: TensorRT cannot parse it:\n" + "\n".join(lines) + "\n" + logger.excerpt())
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_mib << 20)
    _set_target(trt, config, options)
    prof, table = _profile(trt, builder, network, ranges)
    config.add_optimization_profile(prof)
    if options.timing_cache:
        config.set_timing_cache(config.create_timing_cache(cache_bytes), ignore_mismatch=False)
    sources = strip_plan(trt, config, onnx_path, checkpoint) if options.strip_weights else None  # WeightSourceError
    from ..plugins import adapter

    adapter.ERRORS.clear()
    adapter.FORMATS.clear()
    blob = builder.build_serialized_network(network, config)
    if adapter.ERRORS or blob is None or blob.nbytes == 0:
        plugin_errors = "".join(f"  {e}\n" for e in adapter.ERRORS + adapter.format_failures())
        formats = "".join(f"  k3::{n} formats: {s.format_table()}\n" for n, s in specs.items()
                          if f"k3::{n}" in plugin_errors)
        raise EngineBuildError(f"{onnx_path}: engine build failed ({options.runtime}, sm_{sm}):\n{plugin_errors}"
                               f"{formats}{_failing(logger)}{_strip_hint(options)}")
    seconds = time.perf_counter() - t0
    data = bytes(blob)
    meta = {"runtime": options.runtime, "tensorrt_version": trt.__version__, "sm": sm, "plugin_paths": paths,
            "profile": {k: asdict(v) for k, v in ranges.items()}, "input_shapes": table, "bytes": len(data),
            "outputs": [network.get_output(i).name for i in range(network.num_outputs)],
            "build_seconds": round(seconds, 2), "onnx_sha256": onnx_sha256, "stripped": sources is not None}
    if sources is not None:
        meta["weights"] = sources
    replaced = tuple(n for n in (ENGINE_FILE, ENGINE_META, TIMING_CACHE) if (export_dir / n).exists())
    with write_artifact(export_dir, "trt", extra=meta, primary=ENGINE_FILE) as tmp:
        (tmp / ENGINE_FILE).write_bytes(data)
        (tmp / ENGINE_META).write_text(json.dumps(meta, indent=2, sort_keys=True))
        if options.timing_cache:
            (tmp / TIMING_CACHE).write_bytes(bytes(config.get_timing_cache().serialize()))
    log.info("engine %s: %.1f MiB in %.1f s (%s %s, sm_%d)", export_dir / ENGINE_FILE, len(data) / 2**20, seconds,
             options.runtime, trt.__version__, sm)
    return EngineArtifact(export_dir / ENGINE_FILE, meta, replaced)


def _strip_hint(options: EngineOptions) -> str:
    import torch

    gpu = options.runtime != "trt-rtx" or torch.cuda.is_available()
    return "" if not options.strip_weights or gpu else ("\n  --strip-weights: TensorRT-RTX compiles refittable plans "
                                                         "with CUDA (Myelin), so it needs a GPU; build without it here")


def _failing(logger) -> str:
    """The log excerpt, led by the nodes/layers it names."""
    text = logger.excerpt()
    nodes = sorted(set(re.findall(r"(?:node|layer)[:\s]+['\"]?([\w./:-]+)", text, re.I)))
    return (f"  failing node(s): {', '.join(nodes)}\n" if nodes else "") + text
