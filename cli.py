"""`k3x`: one short command per pipeline stage; heavy imports happen inside the commands."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from .cli_decode import Chat, MaxNewTokens, PromptIds, PromptText, Seed, Temperature, TopK, TopP
from .exporter.export import DType, KernelChoice, Target

app = typer.Typer(
    name="k3x",
    help="Kimi-K3 compiled graph export: checkpoint -> torch.export / ONNX / TensorRT / AOTInductor, parity proven.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s")


def fail(message: str) -> None:
    """Print an error that names the bad input and exit 1."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=1)


def parse_ids(text: str, what: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"{what}={text!r}: expected comma-separated integers, e.g. 1,2,3")
    if not ids:
        fail(f"{what}: no token ids given")
    return ids


def load_model_or_fail(checkpoint: Path, dtype: str = "fp32"):
    from .exporter.artifacts import DTYPES
    from .model.checkpoint import CheckpointError, load_checkpoint

    try:
        return load_checkpoint(checkpoint, dtype=DTYPES[dtype])
    except (CheckpointError, FileNotFoundError) as e:
        fail(str(e))


def config_or_fail(preset_name: str | None, checkpoint: Path | None):
    from .model.config import ConfigError, K3Config, preset

    if (preset_name is None) == (checkpoint is None):
        fail("give exactly one of --preset NAME or --checkpoint DIR")
    try:
        return preset(preset_name) if preset_name else K3Config.from_hf(checkpoint / "config.json")
    except ConfigError as e:
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
    from .model import build_model
    from .model.checkpoint import save_checkpoint
    from .model.tiny_tokenizer import tokenizer_files

    cfg = config_or_fail(preset, None)
    try:
        extra = tokenizer_files(cfg.vocab_size) if tokenizer else None
        save_checkpoint(build_model(cfg, seed=seed), out, expert_format=expert_format, extra_files=extra)
    except (ValueError, OSError) as e:
        fail(str(e))
    typer.echo(f"wrote {cfg.name} checkpoint (seed {seed}, experts {expert_format}"
               + (", tokenizer" if tokenizer else "") + f") to {out}")


@app.command()
def inspect(
    preset: Annotated[Optional[str], typer.Option(help="Preset name (k3, kimi-linear-48b, k3-mini, k3-bench).")] = None,
    checkpoint: Annotated[Optional[Path], typer.Option(help="Checkpoint folder (reads its config.json).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Layer plan, total/active parameters, cache sizes, bytes by storage format (meta device: no weights)."""
    import json

    from .model.summary import format_summary, summarize

    s = summarize(config_or_fail(preset, checkpoint))
    typer.echo(json.dumps(s) if json_out else format_summary(s))


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
) -> None:
    """Decode with the eager PyTorch model (prefill, then decode steps carrying state); greedy by default.
    Prints text as it comes when the checkpoint has a tokenizer."""
    import torch

    from .cli_decode import Printer, Sampling, prepare
    from .model.generate import generate as eager_generate

    model = load_model_or_fail(checkpoint)
    p = prepare(checkpoint, model.cfg.vocab_size, prompt, prompt_ids, chat,
                Sampling(max_new_tokens, temperature, top_k, top_p, seed))
    printer = Printer(p.tokenizer)
    g = eager_generate(model, torch.tensor([p.ids]), p.options, on_token=printer)
    printer.finish(g, len(p.ids), "eager, cpu")


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
) -> None:
    """Full-sequence logits, for parity checks by anyone."""
    import numpy as np
    import torch

    from .model.generate import full_logits

    if (input_ids is None) == (batch_file is None):
        fail("give exactly one of --input-ids or --batch-file")
    try:
        ids = np.array([parse_ids(input_ids, "--input-ids")]) if input_ids else np.load(batch_file)
    except (OSError, ValueError) as e:
        fail(f"{batch_file}: cannot read a .npy array ({e})")
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        fail(f"{batch_file}: expected an integer array [B, T], got {ids.dtype} {list(ids.shape)}")
    if backend != "eager":
        result = _export_logits(backend, export_dir, torch.from_numpy(ids.astype(np.int64)), provider)
    else:
        if checkpoint is None:
            fail("backend eager needs --checkpoint DIR")
        model = load_model_or_fail(checkpoint)
        try:
            result = full_logits(model, torch.from_numpy(ids.astype(np.int64)))
        except ValueError as e:
            fail(str(e))
    try:
        save_npy_atomic(out, result.numpy())
    except OSError as e:
        fail(f"{out}: cannot write ({e})")
    typer.echo(f"wrote logits {list(result.shape)} float32 to {out}")


def _export_logits(backend: str, export_dir: Path | None, ids, provider: str):
    """Full-sequence logits from an exported artifact (prefill from an empty state)."""
    from .exporter.runners import RunnerError, RunnerOptions, make_runner, prefill_logits

    if export_dir is None:
        fail(f"backend {backend} needs --export-dir DIR")
    folder = _export_folder(export_dir)
    try:
        runner = make_runner(backend, export_dir, RunnerOptions(provider=provider))
        return prefill_logits(runner, folder.config(), ids, dtype=folder.dtype())
    except (RunnerError, ValueError) as e:
        fail(str(e))


def save_npy_atomic(path: Path, array) -> None:
    import io

    import numpy as np

    from .exporter.artifacts import atomic_write_bytes

    buf = io.BytesIO()
    np.save(buf, array)
    atomic_write_bytes(path, buf.getvalue())


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
) -> None:
    """Trace the model once (torch.export) and write the target's artifacts plus manifest.json."""
    from .exporter.artifacts import ManifestError
    from .exporter.export import ExportOptions, export as run_export

    progress = lambda stage, s: typer.echo(f"[{stage}] " + ("..." if s is None else f"done in {s:.1f} s"))  # noqa: E731
    try:
        options = ExportOptions(tuple(target), out, preset, checkpoint, not no_weights, dtype, seed, kernels)
        result = run_export(options, progress)
    except (ValueError, FileNotFoundError, ManifestError) as e:  # ConfigError, CheckpointError: name the input
        fail(str(e))
    except (OSError, RuntimeError) as e:  # a stage failed; its artifacts were not renamed into place
        fail(f"export to {out} failed: {type(e).__name__}: {e}")
    typer.echo("\n".join(result.notes + [f"manifest: {out / 'manifest.json'}"]))


@app.command("build-engine")
def build_engine_cmd(
    export_dir: Annotated[Path, typer.Argument(help="Export folder holding model.trt.onnx.")],
    min_: Annotated[Optional[list[str]], typer.Option("--min", help="Profile min, e.g. batch=1 (repeatable).")] = None,
    opt: Annotated[Optional[list[str]], typer.Option("--opt", help="Profile opt, e.g. seq=128.")] = None,
    max_: Annotated[Optional[list[str]], typer.Option("--max", help="Profile max, e.g. batch=8.")] = None,
    sm: Annotated[Optional[int], typer.Option(help="Target SM (default 90 for trt, 89 for trt-rtx).")] = None,
    runtime: Annotated[str, typer.Option(help="trt (TensorRT 11) | trt-rtx (TensorRT-RTX, builds on CPU).")] = "trt",
    plugin_path: Annotated[str, typer.Option(help="aot (embedded cubins) | jit (Triton via torch).")] = "aot",
) -> None:
    """Build model.engine from the trt-flavour ONNX with the k3 plugins (profiles from DYNAMIC_DIMS)."""
    from .exporter.trt import EngineBuildError, EngineOptions, build_engine

    dims: dict[str, dict[str, int]] = {}
    for key, items in (("min", min_), ("opt", opt), ("max", max_)):
        for item in items or []:
            name, _, value = item.partition("=")
            if not value.isdigit():
                fail(f"--{key} {item!r}: expected NAME=INT, e.g. batch=8")
            dims.setdefault(name, {})[key] = int(value)
    try:
        art = build_engine(export_dir, EngineOptions(runtime=runtime, sm=sm, plugin_path=plugin_path, dims=dims))
    except (EngineBuildError, ValueError) as e:
        fail(str(e))
    typer.echo(f"{art.path}: {art.meta['bytes'] / 2**20:.1f} MiB, sm_{art.meta['sm']}, "
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
) -> None:
    """Decode with an exported artifact: prefill, then decode steps carrying state; greedy by default.
    Prints text as it comes when the export folder has a tokenizer."""
    import torch

    from .cli_decode import Printer, Sampling, prepare
    from .exporter.runners import RunnerError, RunnerOptions, generate as run_generate, make_runner

    folder = _export_folder(export_dir)
    cfg = folder.config()
    p = prepare(export_dir, cfg.vocab_size, prompt, prompt_ids, chat,
                Sampling(max_new_tokens, temperature, top_k, top_p, seed))
    try:
        runner = make_runner(backend, export_dir, RunnerOptions(provider=provider))
        typer.echo(f"backend {backend}" + (f" on {runner.provider}" if hasattr(runner, "provider") else ""))
        printer = Printer(p.tokenizer)
        g = run_generate(runner, cfg, torch.tensor([p.ids]), p.options, dtype=folder.dtype(), on_token=printer)
    except RunnerError as e:
        fail(str(e))
    printer.finish(g, len(p.ids), backend)


def _export_folder(export_dir: Path):
    from .exporter.artifacts import ExportFolder, ManifestError

    try:
        return ExportFolder.open(export_dir)
    except ManifestError as e:
        fail(f"{export_dir}: not a k3x export folder ({e})")


@app.command()
def verify(
    export_dir: Annotated[Path, typer.Argument(help="Export folder (k3x export).")],
    backends: Annotated[str, typer.Option(help="Comma-separated runners to check against eager.")] = "pt2,ort",
    steps: Annotated[int, typer.Option(min=0, help="Decode steps after the prefill.")] = 8,
    prompt_len: Annotated[int, typer.Option(min=1, help="Prompt length of the prefill.")] = 7,
    batch: Annotated[int, typer.Option(min=1, help="Batch size.")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of the random prompt.")] = 0,
    checkpoint: Annotated[Optional[Path], typer.Option(help="Eager reference checkpoint (default: the export's).")
                          ] = None,
    provider: Annotated[str, typer.Option(help="ONNX Runtime provider: auto, cuda, cpu.")] = "auto",
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write the report as JSON.")] = None,
) -> None:
    """Parity of every backend vs the eager reference over prefill + decode steps; exit 1 on any failure."""
    import json

    from .exporter.runners import RunnerError, RunnerOptions, make_runner
    from .exporter.verify import run_parity

    names = [b.strip() for b in backends.split(",") if b.strip()]
    if not names:
        fail("--backends: name at least one runner")
    folder = _export_folder(export_dir)
    options = RunnerOptions(provider=provider, checkpoint=checkpoint)
    try:
        reference = make_runner("eager", export_dir, options)
        runners = [make_runner(n, export_dir, options) for n in names]
    except RunnerError as e:
        fail(str(e))
    report = run_parity(reference, runners, folder.config(), steps=steps, batch=batch, prompt_len=prompt_len,
                        dtype=folder.dtype(), seed=seed)
    for r in runners:
        if hasattr(r, "provider"):
            typer.echo(f"{r.name}: provider {r.provider}")
    typer.echo(report.table())
    if json_out:
        json_out.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if not report.ok:
        raise typer.Exit(code=1)
