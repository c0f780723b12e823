"""The `k3x` command line (console script `k3x = "k3x.cli:app"`, and `python -m k3x`).

One command per pipeline stage, each a thin view onto the library: parse (flag types in cli_flags.py, checked
before torch loads, so `--help` and bad arguments answer at once), call one library function, print
(console.py). The library's typed input errors become one line and exit 1 in one place (`one_line_errors`);
`-v` may come before or after the command.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable

import typer

from .cli_flags import Activations, Backend, Backends, Batch, BatchFile, BlockSize, CacheBlocks, Chat, Checkpoint, \
    CheckpointRequired, CudaGraph, DType, Draft, EP, EngineExportDir, EngineRuntime, ExpertActivations, ExpertFormat, \
    Experts, ExportDir, ExportOut, FitBatch, FitContext, InitExperts, InitOut, InitPreset, InputIds, InspectExport, \
    Json, JsonOut, JsonReport, KernelChoice, Kernels, LoadState, LogitsBackend, LogitsExportDir, LogitsOut, \
    MaxContext, MaxNewTokens, MaxSequences, MaxStepTokens, ModelDType, NoWeights, OnnxFunctions, OrtProvider, \
    PluginPath, Plugins, PoolDType, PrefixCache, PrefixCacheMB, Preset, PresetSeed, ProfileMax, ProfileMin, \
    ProfileOpt, PromptIds, PromptLen, PromptSeed, PromptText, PromptsFile, PromptsFormat, Provider, \
    ReferenceCheckpoint, RunBackend, Runtime, SM, SamplerSeed, SaveState, Sequences, Serving, SkipHashCheck, \
    Speculate, SpeculateTokens, StepChunk, Steps, StripWeights, TP, Target, Targets, Temperature, Tokenizer, TopK, \
    TopP, TraceMode, TraceModes, Verbose, Version, WeightSeed, WeightSource, WeightsFrom, inspect_rules, run_rules, \
    verify_rules
from .cli_flags import ApiKey, DrainTimeout, Host, MaxQueue, Port, ServeBackend, ServeCacheBlocks, ServedModelName
from .cli_flags import Trunk, TrunkForm
from .console import Printer, Progress, debug, echo, fail, one_line, timed


class App(typer.Typer):
    """`k3x CMD ... -v` works like `k3x -v CMD ...`: the global flag is moved before the command; every
    command's typed input errors are one line (`one_line_errors`)."""

    def __call__(self, *args, **kwargs):
        if not args and "args" not in kwargs:
            kwargs["args"] = hoist_global_flags(sys.argv[1:])
        return super().__call__(*args, **kwargs)

    def command(self, *args, **kwargs):
        register = super().command(*args, **kwargs)
        return lambda f: register(one_line_errors(f))


def input_errors() -> tuple[type[Exception], ...]:
    """The library's typed errors for bad input: each message names the file or field."""
    from .checkpoint.files import CheckpointError
    from .exporter.engine import EngineBuildError
    from .fileio import OutputError
    from .folder.artifacts import ManifestError
    from .folder.staging import FolderError
    from .model.config import ConfigError
    from .runtime.runners import RunnerError
    from .text.prompt import PromptError
    from .text.tokenizer import TokenizerError

    return (ConfigError, TokenizerError, PromptError, CheckpointError, ManifestError, FolderError, EngineBuildError,
            RunnerError, OutputError)


def one_line_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command` with the library's typed input errors (`input_errors`) turned into one `fail` line, wherever
    in the command they are raised (the one mapping; no per-command try/except needed for them)."""
    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except input_errors() as e:  # evaluated only when an exception propagates
            fail(str(e))

    return wrapper


def hoist_global_flags(argv: list[str]) -> list[str]:
    flags = [a for a in argv if a in ("-v", "--verbose")]
    return flags + [a for a in argv if a not in ("-v", "--verbose")]


app = App(
    name="k3x",
    help="Kimi-K3 compiled graph export: checkpoint -> torch.export / ONNX / TensorRT / AOTInductor, parity proven.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,  # plain help: no `<bool>` placeholder after flags (it invited `--chat true`)
)


@app.callback()
def main(verbose: Verbose = False, version: Version = False) -> None:
    """Global flags; `-v` may also follow the command."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("k3x").setLevel(logging.DEBUG if verbose else logging.INFO)


@app.command("init-checkpoint")
def init_checkpoint(preset: InitPreset = "k3-mini", out: InitOut = Path("k3-mini-ckpt"), seed: WeightSeed = 0,
                    expert_format: InitExperts = ExpertFormat.MXFP4, tokenizer: Tokenizer = True) -> None:
    """Write a random-weight checkpoint in the real Hugging Face format (config.json + safetensors). Its
    weights are random: generated text is gibberish (the pipeline, not the model, is what it tests)."""
    from .checkpoint.random_init import init_checkpoint as write

    with timed(f"init-checkpoint {out}"):
        cfg = write(preset, out, seed=seed, expert_format=expert_format.value, tokenizer=tokenizer)
    echo(f"wrote {cfg.name} checkpoint (seed {seed}, experts {expert_format.value}"
         + (", tokenizer" if tokenizer else "") + f") to {out}")


@app.command()
def inspect(ctx: typer.Context, preset: Preset = None, checkpoint: Checkpoint = None, json_out: Json = False,
            tp: TP = 1, ep: EP = 1, batch: FitBatch = 1, context: FitContext = 131072, sequences: Sequences = None,
            dtype: PoolDType = DType.AUTO, chunk: StepChunk = None, export: InspectExport = None) -> None:
    """Layer plan, total/active parameters, cache sizes, bytes by storage format (meta device: no weights);
    with --tp/--ep: per-rank bytes, collective bytes and the fit on H200 / B200 / GB300; with --export: each
    ONNX file's inputs and outputs."""
    from .checkpoint.config_source import config_of

    inspect_rules(ctx)
    if export is not None:
        from .folder.artifacts import read_manifest
        from .folder.onnx_io import onnx_io_report

        return echo(onnx_io_report(read_manifest(export), str(export)))
    from .model.parallel_budget import budget, format_budget
    from .model.summary import format_summary, summarize

    cfg = config_of(preset, checkpoint)
    debug("config %s (hash %s) from %s", cfg.name, cfg.hash()[:12], checkpoint or f"preset {preset}")
    if sequences is not None:  # serving pools
        from .exporter.presets import model_dtype
        from .model.summary import pools_report

        name, why = model_dtype(dtype.value, preset, checkpoint)
        debug("latent dtype %s (%s)", name, why)
        return echo(pools_report(cfg, context, sequences, tp=tp, ep=ep, dtype=name, chunk=chunk))
    with timed("inspect"):
        if tp * ep > 1:
            from .model.parallel import ParallelPlan

            s = budget(cfg, ParallelPlan(tp, ep), batch=batch, context=context)
        else:
            s = summarize(cfg)
    echo(json.dumps(s) if json_out else (format_budget if tp * ep > 1 else format_summary)(s))


@app.command()
def export(out: ExportOut, preset: Preset = None, checkpoint: Checkpoint = None, target: Targets = [Target.PT2],
           no_weights: NoWeights = False, dtype: ModelDType = DType.AUTO, seed: PresetSeed = 0,
           kernels: Kernels = KernelChoice.REFERENCE, tp: TP = 1, ep: EP = 1, expert_format: Experts = None,
           max_context: MaxContext = None, serving: Serving = False, block_size: BlockSize = 16,
           activations: ExpertActivations = Activations.BF16, trace_mode: TraceModes = TraceMode.STAMPED,
           weights: WeightsFrom = WeightSource.COPY, onnx_functions: OnnxFunctions = True,
           trunk: TrunkForm = Trunk.DENSE) -> None:
    """Trace the model once (torch.export) and write the target's artifacts plus manifest.json."""
    from .exporter.options import ExportOptions
    from .exporter.pipeline import export as run_export

    try:
        options = ExportOptions(tuple(target), out, preset, checkpoint, not no_weights, dtype, seed, kernels,
                                expert_format, max_context, tp, ep, serving, block_size, activations, trace_mode,
                                weights, onnx_functions, trunk)
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
    a serving export's: tokens, seqs, table_blocks, logits_rows, slots, blocks). An engine serves one SM:
    TensorRT 11 (--runtime trt) builds for the GPU it runs on (H100 / H200: sm_90); TensorRT-RTX (--runtime
    trt-rtx, builds on a CPU: pip install -e '.[trt-rtx]') for RTX-class GPUs (sm_89 by default: RTX 40xx, L4,
    L40S); its engines do not run on an H100 / H200. The line printed at the end names the GPUs it serves."""
    from .exporter.engine import EngineOptions, build_engine as build, parse_profile
    from .exporter.engine_targets import serves

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
    if art.replaced:
        echo(f"replaced in {export_dir}: {', '.join(art.replaced)}")
    echo(f"{art.path}: {art.meta['bytes'] / 2**20:.1f} MiB{stripped}, sm_{art.meta['sm']}, {art.meta['runtime']} "
         f"{art.meta['tensorrt_version']}, plugins " + ", ".join(f"{k}={v}" for k, v in art.meta["plugin_paths"].items())
         + f"; {serves(art.meta['runtime'], art.meta['sm'], art.meta['tensorrt_version'])}")


@app.command("build-ort-kernels")
def build_ort_kernels() -> None:
    """Compile the k3 ops' ONNX Runtime CPU kernels into one library in the user cache; CPU sessions load it
    from then on (K3X_ORT_KERNELS=0: not). Needs g++ (or $CXX) and ONNX Runtime's C/C++ API headers, installed:
    apt install libonnxruntime-dev (Debian 13 and later; on Debian 12, `bash scripts/ort_headers.sh` in a k3x checkout),
    found in the standard include folders or an installed Python package; K3X_ORT_INCLUDE names another folder."""
    from .runtime.ort_kernels import build, sources

    path = build(progress=echo)
    echo(f"{path}: kernels of the op families " + ", ".join(sources()))


@app.command()
def generate(checkpoint: CheckpointRequired, prompt: PromptText = None, prompt_ids: PromptIds = None,
             chat: Chat = False, max_new_tokens: MaxNewTokens = 16, temperature: Temperature = 0.0, top_k: TopK = 0,
             top_p: TopP = 1.0, seed: SamplerSeed = None, cuda_graph: CudaGraph = False) -> None:
    """Decode with the eager PyTorch model (prefill, then decode steps carrying state); greedy by default.
    Prints text as it comes when the checkpoint has a tokenizer (random weights give gibberish)."""
    import torch

    from .checkpoint.config_source import config_of
    from .runtime.eager import eager_generate, load_for
    from .text.prompt import Sampling, prepare

    p = prepare(checkpoint, config_of(None, checkpoint).vocab_size, prompt, prompt_ids, chat,
                Sampling(max_new_tokens, temperature, top_k, top_p, seed))
    with timed(f"load {checkpoint}"):
        model = load_for(checkpoint, batch=1, prompt_len=len(p.ids), new_tokens=max_new_tokens)
    printer = Printer(p.tokenizer, p.options.eos_token_ids)
    try:
        g = eager_generate(model, torch.tensor([p.ids]), p.options, printer, cuda_graph)
    except ValueError as e:
        fail(f"generate: {one_line(e)}")
    printer.finish(g, len(p.ids), "eager, cuda graph" if cuda_graph else "eager, cpu")


@app.command()
def run(ctx: typer.Context, export_dir: ExportDir, backend: RunBackend = Backend.ORT, prompt: PromptText = None,
        prompt_ids: PromptIds = None, chat: Chat = False, max_new_tokens: MaxNewTokens = 16,
        temperature: Temperature = 0.0, top_k: TopK = 0, top_p: TopP = 1.0, seed: SamplerSeed = None,
        provider: OrtProvider = Provider.AUTO, skip_hash_check: SkipHashCheck = False,
        cuda_graph: CudaGraph = False, prompts: PromptsFile = None, prompts_format: PromptsFormat = None,
        max_sequences: MaxSequences = 8, cache_blocks: CacheBlocks = None, max_step_tokens: MaxStepTokens = 512,
        json_out: JsonOut = None, save_state: SaveState = None, load_state: LoadState = None,
        prefix_cache: PrefixCache = False, prefix_cache_mb: PrefixCacheMB = 1024.0, speculate: Speculate = None,
        draft: Draft = None, speculate_tokens: SpeculateTokens = 4) -> None:
    """Decode with an exported artifact: prefill, then decode steps carrying state; greedy by default.
    Prints text as it comes when the export folder has a tokenizer (random weights give gibberish; an id the
    tokenizer lacks shows as <unk:ID>). A serving export (export --serving) serves --prompts FILE (or the one
    prompt) by continuous batching, optionally with a prefix cache and speculating (--speculate ngram:K, or
    --draft EXPORT --speculate-tokens K; greedy). --save-state / --load-state hand a sequence's state from the
    prefill to a decode in another process. A flag that cannot apply to the export is refused."""
    from .fileio import check_output
    from .folder.artifacts import ExportFolder
    from .runtime import command_session as cs
    from .text.prompt import Sampling, prepare

    folder = ExportFolder.open(export_dir)
    debug("export %s: %s, artifacts %s", export_dir, folder.config().name, ", ".join(folder.manifest["artifacts"]))
    run_rules(ctx, "serving" in folder.manifest)
    inputs = [("--prompts", prompts), ("--load-state", load_state), ("the export", export_dir), ("--draft", draft)]
    if json_out is not None:
        check_output(json_out, flag="--json", inputs=inputs + [("--save-state", save_state)], stream=True)
    p = prepare(export_dir, folder.config().vocab_size, prompt, prompt_ids, chat,
                Sampling(max_new_tokens, temperature, top_k, top_p, seed), folder.tokenizer_files())
    if save_state is not None or load_state is not None:
        cs.check_state_flags(export_dir, folder, prompts, load_state, load_state is not None and (prompt or prompt_ids),
                             prefix_cache and load_state is not None)
    if prompts is not None or "serving" in folder.manifest:  # continuous batching, any rank count
        from .runtime.runners import serving_entry
        from .runtime.serve import ServeOptions
        from .runtime.serve_prompts import Speculation, run_prompts
        from .text.prompts_file import PromptRequest, read_prompts

        block = int(serving_entry(folder)["block_size"])  # refused here, and the prompts read, before ranks spawn
        requests = ([PromptRequest(p.ids, None, 0)] if prompts is None else
                    read_prompts(prompts, p.tokenizer, folder.config().vocab_size, p.options, prompts_format))
        files = (save_state, load_state) if save_state is not None or load_state is not None else None
        names, notes = cs.ranks_here(export_dir, [backend.value], default_ort=True)
        return run_prompts(folder, requests, p, (names[0], notes), ServeOptions(
            max_sequences, cache_blocks, block, max_step_tokens, prefix_cache=prefix_cache,
            prefix_cache_bytes=int(prefix_cache_mb * 1e6) if prefix_cache else 0), (json_out, inputs, prompts),
            cs.runner_options(provider.value, skip_hash_check), Speculation(speculate, draft, speculate_tokens), files)
    cs.decode_export(export_dir, folder, backend.value, p, cs.runner_options(provider.value, skip_hash_check,
                     cuda_graph=cuda_graph), save_state=save_state, load_state=load_state)


@app.command()
def serve(export_dir: ExportDir, backend: ServeBackend = Backend.ORT, max_sequences: MaxSequences = 8,
          cache_blocks: ServeCacheBlocks = None, max_step_tokens: MaxStepTokens = 512,
          prefix_cache: PrefixCache = False, prefix_cache_mb: PrefixCacheMB = 1024.0, speculate: Speculate = None,
          draft: Draft = None, speculate_tokens: SpeculateTokens = 4, host: Host = "127.0.0.1", port: Port = 8000,
          api_key: ApiKey = None, served_model_name: ServedModelName = None, max_queue: MaxQueue = 256,
          drain_timeout: DrainTimeout = 30.0, provider: OrtProvider = Provider.AUTO,
          skip_hash_check: SkipHashCheck = False) -> None:
    """Serve a serving export (export --serving) over HTTP with OpenAI's API: /v1/completions,
    /v1/chat/completions, /v1/models, /health, /metrics. Requests are batched continuously as they arrive and
    streamed as server-sent events; SIGTERM drains (new requests 503), a second signal exits at once."""
    from .runtime.command_session import runner_options
    from .runtime.serve import ServeOptions
    from .runtime.serve_prompts import Speculation
    from .server.run import HttpOptions, serve_export

    serve_export(export_dir, backend.value, ServeOptions(
        max_sequences, cache_blocks, max_step_tokens=max_step_tokens, prefix_cache=prefix_cache,
        prefix_cache_bytes=int(prefix_cache_mb * 1e6) if prefix_cache else 0),
        HttpOptions(host, port, api_key, served_model_name, max_queue, drain_timeout),
        runner_options(provider.value, skip_hash_check), Speculation(speculate, draft, speculate_tokens))


@app.command()
def logits(out: LogitsOut, checkpoint: Checkpoint = None, input_ids: InputIds = None, batch_file: BatchFile = None,
           backend: LogitsBackend = Backend.EAGER, export_dir: LogitsExportDir = None,
           provider: OrtProvider = Provider.AUTO, skip_hash_check: SkipHashCheck = False) -> None:
    """Full-sequence logits, for parity checks by anyone."""
    if (input_ids is None) == (batch_file is None):
        fail("give exactly one of --input-ids or --batch-file")
    if backend == Backend.EAGER and checkpoint is None:
        fail("backend eager needs --checkpoint DIR")
    if backend != Backend.EAGER and export_dir is None:
        fail(f"backend {backend.value} needs --export-dir DIR")
    import numpy as np
    import torch

    from .folder.artifacts import ExportFolder
    from .runtime.eager import checkpoint_logits
    from .runtime.command_session import runner_options
    from .runtime.logits import export_logits, read_ids_npy, save_npy
    from .fileio import check_output
    from .text.prompt import parse_ids

    inputs = [("--batch-file", batch_file), ("--checkpoint", checkpoint), ("--export-dir", export_dir)]
    check_output(out, flag="--out", inputs=inputs)  # before any work
    ids = torch.from_numpy((np.array([parse_ids(input_ids, "--input-ids")]) if input_ids
                            else read_ids_npy(batch_file)).astype(np.int64))
    with timed(f"logits {list(ids.shape)} ({backend.value})"):
        result = (checkpoint_logits(checkpoint, ids) if backend == Backend.EAGER else
                  export_logits(ExportFolder.open(export_dir), backend.value, ids,
                                runner_options(provider.value, skip_hash_check)))
    save_npy(out, result.numpy(), inputs)
    echo(f"wrote logits {list(result.shape)} float32 to {out}")


@app.command()
def verify(ctx: typer.Context, export_dir: ExportDir, backends: Backends = "", steps: Steps = 8, prompt_len: PromptLen = 7,
           batch: Batch = 1, seed: PromptSeed = 0, checkpoint: ReferenceCheckpoint = None,
           provider: OrtProvider = Provider.AUTO, json_out: JsonReport = None, skip_hash_check: SkipHashCheck = False,
           cuda_graph: CudaGraph = False) -> None:
    """Parity of every backend vs the eager reference over prefill + decode steps (any rank count; a serving
    export: its step with the true state handed in), and each backend's state against the export's state
    contract; exit 1 on any failure."""
    from .folder.artifacts import ExportFolder
    from .runtime.command_session import runner_options
    from .runtime.verify_export import verify_export

    verify_rules(ctx, "serving" in ExportFolder.open(export_dir).manifest)
    if not verify_export(export_dir, [b.strip() for b in backends.split(",") if b.strip()],
                         runner_options(provider.value, skip_hash_check, checkpoint, cuda_graph), steps=steps,
                         prompt_len=prompt_len, batch=batch, seed=seed, json_out=json_out):
        raise typer.Exit(code=1)
