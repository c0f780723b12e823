"""`k3x`: one short command per pipeline stage; heavy imports happen inside the commands."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from .cli_decode import Chat, MaxNewTokens, PromptIds, PromptText, Seed, Temperature, TopK, TopP
from .cli_parallel import EP, TP, FitBatch, FitContext, inspect_parallel
from .cli_serve import BlockSize, CacheBlocks, JsonOut, MaxSequences, MaxStepTokens, PromptsFile, Sequences, Serving, \
    print_pools, run_prompts
from .cli_runner import CudaGraph, MaxContext, SkipHashCheck, close_session, eager_generate, open_session, \
    reference_options, runner_options
from .cli_support import App, Progress, echo, export_folder as _export_folder, fail, load_ids_npy, one_line, \
    parse_ids, save_npy_atomic
from .export.pipeline import DType, ExpertFormat, KernelChoice, Target

app = App(
    name="k3x",
    help="Kimi-K3 compiled graph export: checkpoint -> torch.export / ONNX / TensorRT / AOTInductor, parity proven.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s")


def load_model_or_fail(checkpoint: Path, dtype: str = "fp32"):
    from .checkpoint.files import CheckpointError, load_checkpoint
    from .folder.artifacts import DTYPES

    try:
        return load_checkpoint(checkpoint, dtype=DTYPES[dtype])
    except (CheckpointError, FileNotFoundError) as e:
        fail(str(e))


def config_or_fail(preset_name: str | None, checkpoint: Path | None):
    from .checkpoint.files import CheckpointError, checkpoint_file
    from .checkpoint.hf_config import config_from_hf
    from .model.config import ConfigError, preset

    if (preset_name is None) == (checkpoint is None):
        fail("give exactly one of --preset NAME or --checkpoint DIR")
    try:
        return preset(preset_name) if preset_name else config_from_hf(checkpoint_file(checkpoint, "config.json"))
    except (ConfigError, CheckpointError) as e:
        fail(str(e))


@app.command("init-checkpoint")
def init_checkpoint(
    preset: Annotated[str, typer.Option(help="Preset to instantiate (k3-mini, k3-bench, ...).")] = "k3-mini",
    out: Annotated[Path, typer.Option(help="Folder to create (must not exist or be empty).")] = Path("k3-mini-ckpt"),
    seed: Annotated[int, typer.Option(help="Random seed of the weights.")] = 0,
    expert_format: Annotated[str, typer.Option(help="mxfp4 (as the real K3 checkpoint) or dense.")] = "mxfp4",
    tokenizer: Annotated[bool, typer.Option(help="Also write a small byte-level BPE tokenizer trained at init "
                                                 "(text in and out with --prompt).")] = True,
) -> None:
    """Write a random-weight checkpoint in the real Hugging Face format (config.json + safetensors)."""
    from .checkpoint.files import save_checkpoint
    from .model import build_model
    from .text.tiny_tokenizer import tokenizer_files

    cfg = config_or_fail(preset, None)
    try:
        extra = tokenizer_files(cfg.vocab_size) if tokenizer else None
        save_checkpoint(build_model(cfg, seed=seed), out, expert_format=expert_format, extra_files=extra)
    except (ValueError, OSError) as e:
        fail(str(e))
    echo(f"wrote {cfg.name} checkpoint (seed {seed}, experts {expert_format}"
               + (", tokenizer" if tokenizer else "") + f") to {out}")


@app.command()
def inspect(
    preset: Annotated[Optional[str], typer.Option(help="Preset name (k3, kimi-linear-48b, k3-mini, k3-bench).")] = None,
    checkpoint: Annotated[Optional[Path], typer.Option(help="Checkpoint folder (reads its config.json).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    tp: TP = 1, ep: EP = 1, batch: FitBatch = 1, context: FitContext = 131072,
    sequences: Sequences = None,
) -> None:
    """Layer plan, total/active parameters, cache sizes, bytes by storage format (meta device: no weights);
    with --tp/--ep: per-rank bytes, collective bytes and the fit on H200 / B200 / GB300."""
    import json

    from .model.summary import format_summary, summarize

    if sequences is not None:
        return print_pools(config_or_fail(preset, checkpoint), context, sequences)
    if tp * ep > 1:
        return inspect_parallel(config_or_fail(preset, checkpoint), tp, ep, batch, context, json_out)
    s = summarize(config_or_fail(preset, checkpoint))
    echo(json.dumps(s) if json_out else format_summary(s))


@app.command()
def generate(
    checkpoint: Annotated[Path, typer.Option(help="Checkpoint folder.")],
    prompt: PromptText = None,
    prompt_ids: PromptIds = None,
    chat: Chat = False,
    max_new_tokens: MaxNewTokens = 16,
    temperature: Temperature = 0.0,
    top_k: TopK = 0,
    top_p: TopP = 1.0,
    seed: Seed = None,
    cuda_graph: CudaGraph = False,
) -> None:
    """Decode with the eager PyTorch model (prefill, then decode steps carrying state); greedy by default.
    Prints text as it comes when the checkpoint has a tokenizer."""
    import torch

    from .cli_decode import Printer, Sampling, prepare
    from .runtime.runners import RunnerError, check_request

    cfg = config_or_fail(None, checkpoint)
    p = prepare(checkpoint, cfg.vocab_size, prompt, prompt_ids, chat,
                Sampling(max_new_tokens, temperature, top_k, top_p, seed))
    try:
        check_request(cfg, batch=1, prompt_len=len(p.ids), new_tokens=max_new_tokens)
    except RunnerError as e:
        fail(str(e))
    model = load_model_or_fail(checkpoint)
    printer = Printer(p.tokenizer)
    try:
        g = eager_generate(model, torch.tensor([p.ids]), p.options, printer, cuda_graph)
    except (ValueError, RunnerError) as e:
        fail(str(e) if isinstance(e, RunnerError) else f"generate: {one_line(e)}")
    printer.finish(g, len(p.ids), "eager, cuda graph" if cuda_graph else "eager, cpu")


@app.command()
def logits(
    out: Annotated[Path, typer.Option(help="Where to write float32 logits [B, T, vocab] (.npy).")],
    checkpoint: Annotated[Optional[Path], typer.Option(help="Checkpoint folder (backend eager).")] = None,
    input_ids: Annotated[Optional[str], typer.Option(help="Comma-separated token ids (batch of one).")] = None,
    batch_file: Annotated[Optional[Path], typer.Option(help=".npy int array [B, T] of token ids.")] = None,
    backend: Annotated[str, typer.Option(help="eager (from --checkpoint), or pt2 / ort (from --export-dir).")
                       ] = "eager",
    export_dir: Annotated[Optional[Path], typer.Option(help="Export folder (backends pt2, ort).")] = None,
    provider: Annotated[str, typer.Option(help="ONNX Runtime provider: auto, cuda, cpu.")] = "auto",
    skip_hash_check: SkipHashCheck = False,
) -> None:
    """Full-sequence logits, for parity checks by anyone."""
    import numpy as np
    import torch

    from .runtime.generate import full_logits

    if (input_ids is None) == (batch_file is None):
        fail("give exactly one of --input-ids or --batch-file")
    ids = np.array([parse_ids(input_ids, "--input-ids")]) if input_ids else load_ids_npy(batch_file)
    if backend != "eager":
        result = _export_logits(backend, export_dir, torch.from_numpy(ids.astype(np.int64)),
                                runner_options(provider, skip_hash_check))
    else:
        from .runtime.runners import RunnerError, check_request

        if checkpoint is None:
            fail("backend eager needs --checkpoint DIR")
        try:
            check_request(config_or_fail(None, checkpoint), batch=ids.shape[0], prompt_len=ids.shape[1], new_tokens=1)
        except RunnerError as e:
            fail(str(e))
        model = load_model_or_fail(checkpoint)
        try:
            result = full_logits(model, torch.from_numpy(ids.astype(np.int64)))
        except Exception as e:  # noqa: BLE001 - one line, no traceback
            fail(f"eager: {one_line(e)}")
    try:
        save_npy_atomic(out, result.numpy())
    except OSError as e:
        fail(f"{out}: cannot write ({e})")
    echo(f"wrote logits {list(result.shape)} float32 to {out}")


def _export_logits(backend: str, export_dir: Path | None, ids, options):
    """Full-sequence logits from an exported artifact (prefill from an empty state)."""
    from .runtime.runners import RunnerError, check_request, make_runner, prefill_logits

    if export_dir is None:
        fail(f"backend {backend} needs --export-dir DIR")
    folder = _export_folder(export_dir)
    try:
        cache = folder.options().cache
        check_request(folder.config(), batch=ids.shape[0], prompt_len=ids.shape[1], new_tokens=1,
                      dims=folder.manifest["dynamic_dims"], backend=backend, cache=cache)
        runner = make_runner(backend, export_dir, options)
        return prefill_logits(runner, folder.config(), ids, dtype=folder.dtype(), cache=cache)
    except (RunnerError, ValueError) as e:
        fail(str(e))
    except Exception as e:  # noqa: BLE001 - one line, no traceback
        fail(f"backend {backend}: {one_line(e)}")


@app.command()
def export(
    out: Annotated[Path, typer.Option(help="Export folder (created; each artifact renamed into place).")],
    preset: Annotated[Optional[str], typer.Option(help="Preset name (k3, kimi-linear-48b, k3-mini, k3-bench).")] = None,
    checkpoint: Annotated[Optional[Path], typer.Option(help="Checkpoint folder (config.json + safetensors).")] = None,
    target: Annotated[list[Target], typer.Option(help="Artifact(s) to build from the one trace (repeatable).")
                      ] = [Target.PT2],
    no_weights: Annotated[bool, typer.Option("--no-weights", help="Trace on the meta device: any size, no weights.")
                          ] = False,
    dtype: Annotated[DType, typer.Option(help="Model dtype (states stay fp32).")] = DType.FP32,
    seed: Annotated[int, typer.Option(help="Seed of a preset's random weights.")] = 0,
    kernels: Annotated[KernelChoice, typer.Option(
        help="k3 custom-op implementation traced into the program: reference (PyTorch, any device) or triton "
             "(Triton kernels, CUDA only). Not the runner: that is `k3x run --backend`.")] = KernelChoice.REFERENCE,
    tp: TP = 1,
    ep: EP = 1,
    expert_format: Annotated[Optional[ExpertFormat], typer.Option(help="mxfp4 (packed) or dense experts.")] = None,
    max_context: MaxContext = None,
    serving: Serving = False,
    block_size: BlockSize = 16,
) -> None:
    """Trace the model once (torch.export) and write the target's artifacts plus manifest.json."""
    import errno

    from .export.pipeline import ExportOptions, export as run_export
    from .folder.artifacts import ManifestError
    from .folder.staging import FolderError

    try:
        options = ExportOptions(tuple(target), out, preset, checkpoint, not no_weights, dtype, seed, kernels,
                                expert_format, max_context, tp, ep, serving, block_size)
        with Progress() as progress:
            result = run_export(options, progress)
    except (ValueError, FileNotFoundError, ManifestError, FolderError) as e:  # ConfigError, ...: name the input
        fail(str(e))
    except typer.Exit:  # a `fail` inside (typer.Exit is a RuntimeError): already one line
        raise
    except OSError as e:  # nothing was renamed into place: `out` is as it was
        what = "no space left on device" if e.errno == errno.ENOSPC else f"{type(e).__name__}: {e}"
        fail(f"export to {out} failed: {what}; nothing was written")
    except RuntimeError as e:  # a stage failed; its artifacts were not renamed into place
        fail(f"export to {out} failed: {type(e).__name__}: {e}")
    echo("\n".join(result.notes + [f"manifest: {out / 'manifest.json'}"]))


@app.command("build-engine")
def build_engine_cmd(
    export_dir: Annotated[Path, typer.Argument(help="Export folder holding model.trt.onnx.")],
    min_: Annotated[Optional[list[str]], typer.Option("--min", help="Profile min, e.g. batch=1 (repeatable).")] = None,
    opt: Annotated[Optional[list[str]], typer.Option("--opt", help="Profile opt, e.g. seq=128.")] = None,
    max_: Annotated[Optional[list[str]], typer.Option("--max", help="Profile max, e.g. batch=8.")] = None,
    sm: Annotated[Optional[int], typer.Option(help="Target SM (default 90 for trt, 89 for trt-rtx).")] = None,
    runtime: Annotated[str, typer.Option(help="auto (trt when TensorRT 11 and a GPU are here, else trt-rtx) | trt "
                                              "(TensorRT 11) | trt-rtx (TensorRT-RTX, builds on CPU).")] = "auto",
    plugin_path: Annotated[str, typer.Option(help="aot (embedded cubins) | jit (Triton via torch).")] = "aot",
) -> None:
    """Build model.engine from the trt-flavour ONNX with the k3 plugins (profiles from DYNAMIC_DIMS)."""
    from .export.engine import EngineOptions, build_engine, parse_profile

    try:  # EngineBuildError, FolderError, ManifestError: one line by App (cli_support.one_line_errors)
        dims = parse_profile({"min": min_ or [], "opt": opt or [], "max": max_ or []})
        art = build_engine(export_dir, EngineOptions(runtime=runtime, sm=sm, plugin_path=plugin_path, dims=dims))
    except ValueError as e:  # a profile flag or option
        fail(str(e))
    except OSError as e:  # the lock, the staging folder or the engine file: nothing was renamed into place
        where = f" ({e.filename})" if e.filename else ""
        fail(f"build-engine in {export_dir} failed: {e.strerror or e}{where}; nothing was written")
    echo(f"{art.path}: {art.meta['bytes'] / 2**20:.1f} MiB, sm_{art.meta['sm']}, "
               f"{art.meta['runtime']} {art.meta['tensorrt_version']}, plugins "
               + ", ".join(f"{k}={v}" for k, v in art.meta["plugin_paths"].items()))


@app.command()
def run(
    export_dir: Annotated[Path, typer.Argument(help="Export folder (k3x export).")],
    backend: Annotated[str, typer.Option(help="Runner: ort, pt2, aoti, trt or eager.")] = "ort",
    prompt: PromptText = None,
    prompt_ids: PromptIds = None,
    chat: Chat = False,
    max_new_tokens: MaxNewTokens = 16,
    temperature: Temperature = 0.0,
    top_k: TopK = 0,
    top_p: TopP = 1.0,
    seed: Seed = None,
    provider: Annotated[str, typer.Option(help="ONNX Runtime provider: auto (CUDA if it initialises), cuda, cpu.")
                        ] = "auto",
    skip_hash_check: SkipHashCheck = False,
    cuda_graph: CudaGraph = False,
    prompts: PromptsFile = None,
    max_sequences: MaxSequences = 8,
    cache_blocks: CacheBlocks = None,
    max_step_tokens: MaxStepTokens = 512,
    json_out: JsonOut = None,
) -> None:
    """Decode with an exported artifact: prefill, then decode steps carrying state; greedy by default.
    Prints text as it comes when the export folder has a tokenizer. A serving export (export --serving)
    serves --prompts FILE (or the one prompt) by continuous batching."""
    import torch

    from .cli_decode import Printer, Sampling, prepare
    from .runtime import session as sessions
    from .runtime.runners import RunnerError

    folder = _export_folder(export_dir)
    p = prepare(export_dir, folder.config().vocab_size, prompt, prompt_ids, chat,
                Sampling(max_new_tokens, temperature, top_k, top_p, seed), folder)
    if prompts is not None or "serving" in folder.manifest:  # continuous batching (cli_serve.py)
        return run_prompts(export_dir, prompts or [p.ids], p, backend, (max_sequences, cache_blocks, max_step_tokens),
                           json_out, runner_options(provider, skip_hash_check))
    s = open_session(export_dir, [backend], runner_options(provider, skip_hash_check, cuda_graph=cuda_graph),
                      default_ort=True)
    (backend,) = s.runners
    try:
        sessions.check(s, batch=1, prompt_len=len(p.ids), new_tokens=max_new_tokens, backends=[backend])
        runner = s.runners[backend]
        if s.speaks:
            echo(f"backend {backend}" + (f" on {runner.provider}" if hasattr(runner, "provider") else ""))
        printer = Printer(p.tokenizer if s.speaks else None)
        g = sessions.decode(s, backend, torch.tensor([p.ids]), p.options, on_token=printer)
    except RunnerError as e:
        fail(f"{s.who}{e}")
    except Exception as e:  # noqa: BLE001 - one line (per rank), no traceback
        fail(f"{s.who}backend {backend}: {one_line(e)}")
    if s.speaks:
        printer.finish(g, len(p.ids), s.describe(backend))
    close_session(s)


@app.command()
def verify(
    export_dir: Annotated[Path, typer.Argument(help="Export folder (k3x export).")],
    backends: Annotated[str, typer.Option(help="Comma-separated runners to check against eager (default: every "
                                               "backend the export has; trt only with a CUDA GPU).")] = "",
    steps: Annotated[int, typer.Option(min=0, help="Decode steps after the prefill.")] = 8,
    prompt_len: Annotated[int, typer.Option(min=1, help="Prompt length of the prefill.")] = 7,
    batch: Annotated[int, typer.Option(min=1, help="Batch size.")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of the random prompt.")] = 0,
    checkpoint: Annotated[Optional[Path], typer.Option(help="Eager reference checkpoint (default: the export's).")
                          ] = None,
    provider: Annotated[str, typer.Option(help="ONNX Runtime provider: auto, cuda, cpu.")] = "auto",
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write the report as JSON.")] = None,
    skip_hash_check: SkipHashCheck = False,
    cuda_graph: CudaGraph = False,
) -> None:
    """Parity of every backend vs the eager reference over prefill + decode steps; exit 1 on any failure."""
    import json

    from .runtime import session as sessions
    from .runtime.runners import RunnerError, make_runner

    _export_folder(export_dir)
    options = runner_options(provider, skip_hash_check, checkpoint, cuda_graph)
    s = open_session(export_dir, [b.strip() for b in backends.split(",") if b.strip()], options)
    names = list(s.runners)
    if not names:
        fail(f"{export_dir}: no runnable artifact (exported with --no-weights?); name runners with --backends")
    try:
        sessions.check(s, batch=batch, prompt_len=prompt_len, new_tokens=steps + 1, backends=["eager"] + names)
        reference = make_runner("eager", export_dir, reference_options(options))
        verdict = sessions.verify_session(s, reference, names, steps=steps, batch=batch, prompt_len=prompt_len,
                                          seed=seed)
    except RunnerError as e:
        fail(f"{s.who}{e}")
    except Exception as e:  # noqa: BLE001 - e.g. the eager reference failing: one line, no traceback
        fail(f"{s.who or 'verify: '}{one_line(e)}")
    if s.speaks:
        for r in s.runners.values():
            if hasattr(r, "provider"):
                echo(f"{r.name}: provider {r.provider}")
        echo(verdict.report.table())
        if verdict.greedy is not None:
            g = verdict.greedy
            echo(f"greedy tokens ({steps + 1}): " + ("identical" if g["identical"] else
                                                           f"DIFFER {g['got']} != {g['tokens']}"))
        if json_out:
            from .folder.artifacts import atomic_write_bytes

            atomic_write_bytes(json_out, (json.dumps(verdict.to_json(s, names), indent=2) + "\n").encode())
    close_session(s)
    if not verdict.ok:
        raise typer.Exit(code=1)
