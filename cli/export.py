"""Commands that build artifacts: `export` (one trace, the targets' artifacts and
manifest.json, for any rank count), `build-engine` (model.engine from the trt-flavour ONNX) and
`build-ort-kernels` (the k3 ops' ONNX Runtime CPU kernels, runtime/ort_kernels.py)."""

from __future__ import annotations

import errno

import typer

from .app import app
from .console import Progress, debug, echo, fail
from .options import EP, TP, Activations, BlockSize, Checkpoint, EngineExportDir, EngineRuntime, ExpertActivations, \
    Experts, ExportOut, Kernels, KernelChoice, MaxContext, ModelDType, DType, NoWeights, Plugins, PluginPath, Preset, \
    PresetSeed, ProfileMax, ProfileMin, ProfileOpt, Runtime, SM, Serving, StripWeights, Target, Targets, TraceMode, \
    OnnxFunctions, TraceModes, WeightSource, WeightsFrom


@app.command()
def export(out: ExportOut, preset: Preset = None, checkpoint: Checkpoint = None, target: Targets = [Target.PT2],
           no_weights: NoWeights = False, dtype: ModelDType = DType.FP32, seed: PresetSeed = 0,
           kernels: Kernels = KernelChoice.REFERENCE, tp: TP = 1, ep: EP = 1, expert_format: Experts = None,
           max_context: MaxContext = None, serving: Serving = False, block_size: BlockSize = 16,
           activations: ExpertActivations = Activations.BF16, trace_mode: TraceModes = TraceMode.STAMPED,
           weights: WeightsFrom = WeightSource.COPY, onnx_functions: OnnxFunctions = True) -> None:
    """Trace the model once (torch.export) and write the target's artifacts plus manifest.json."""
    from ..export.options import ExportOptions
    from ..export.pipeline import export as run_export

    try:
        options = ExportOptions(tuple(target), out, preset, checkpoint, not no_weights, dtype, seed, kernels,
                                expert_format, max_context, tp, ep, serving, block_size, activations, trace_mode,
                                weights, onnx_functions)
        debug("export options: %s", options)
        with Progress() as progress:
            result = run_export(options, progress)
    except (ValueError, FileNotFoundError) as e:  # an input the library names (typed ones: App)
        fail(str(e))
    except typer.Exit:  # a `fail` inside (typer.Exit is a RuntimeError): already one line
        raise
    except OSError as e:  # nothing was renamed into place: `out` is as it was
        what = "no space left on device" if e.errno == errno.ENOSPC else f"{type(e).__name__}: {e}"
        fail(f"export to {out} failed: {what}; nothing was written")
    except RuntimeError as e:  # a stage failed; its artifacts were not renamed into place
        fail(f"export to {out} failed: {type(e).__name__}: {e}")
    for name, art in result.manifest.get("artifacts", {}).items():
        debug("artifact %s: %s", name, ", ".join(f"{out / f['path']} ({f['bytes']:,} B)" for f in art["files"]))
    debug("stage timings: %s", ", ".join(f"{k} {v:.2f} s" for k, v in result.timings.items()))
    echo("\n".join(result.notes + [f"manifest: {out / 'manifest.json'}"]))


@app.command("build-engine")
def build_engine(export_dir: EngineExportDir, min_: ProfileMin = None, opt: ProfileOpt = None,
                 max_: ProfileMax = None, sm: SM = None, runtime: EngineRuntime = Runtime.AUTO,
                 plugin_path: Plugins = PluginPath.AOT, strip_weights: StripWeights = False) -> None:
    """Build model.engine from the trt-flavour ONNX with the k3 plugins (profile over the export's dynamic dims;
    a serving export's: tokens, seqs, table_blocks, logits_rows, slots, blocks).
    TensorRT-RTX (builds on a CPU): pip install -e '.[trt-rtx]'."""
    from ..export.engine import EngineOptions, build_engine as build, parse_profile

    try:
        dims = parse_profile({"min": min_ or [], "opt": opt or [], "max": max_ or []})
        options = EngineOptions(runtime=runtime.value, sm=sm, plugin_path=plugin_path.value, dims=dims,
                                strip_weights=strip_weights)
        debug("build-engine %s: runtime %s, sm_%d, plugins %s, profile overrides %s", export_dir, options.runtime,
              options.target_sm, options.plugin_path, dims)
        art = build(export_dir, options)
    except ValueError as e:  # a profile flag or option (typed errors: App)
        fail(str(e))
    except OSError as e:  # the lock, the staging folder or the engine file: nothing was renamed into place
        where = f" ({e.filename})" if e.filename else ""
        fail(f"build-engine in {export_dir} failed: {e.strerror or e}{where}; nothing was written")
    stripped = f", weight-stripped ({len(art.meta['weights'])} weights refitted at load)" if art.meta["stripped"] else ""
    echo(f"{art.path}: {art.meta['bytes'] / 2**20:.1f} MiB{stripped}, sm_{art.meta['sm']}, {art.meta['runtime']} "
         f"{art.meta['tensorrt_version']}, plugins " + ", ".join(f"{k}={v}" for k, v in art.meta["plugin_paths"].items()))


@app.command("build-ort-kernels")
def build_ort_kernels() -> None:
    """Compile the k3 ops' ONNX Runtime CPU kernels into one library in the user cache; CPU sessions load it
    from then on (K3X_ORT_KERNELS=0: not). Needs g++ (or $CXX) and ONNX Runtime's API headers: K3X_ORT_INCLUDE,
    or else Debian's libonnxruntime-dev package, fetched once and checked by sha256."""
    from ..runtime.ort_kernels import build, sources

    path = build(progress=echo)
    echo(f"{path}: kernels of the op families " + ", ".join(sources()))
