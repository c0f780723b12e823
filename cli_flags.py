"""Every flag type of `k3x`, in one place: each command declares its parameters with these `Annotated`
aliases, so a flag's name, help, default checks and choices are written once.

Notable choices:
- Arguments are checked while parsing, before a command imports torch (4-8 s): folders that must exist
  (`must_exist`), and choices as Enums whose values mirror the library's tables (torch-free here;
  tests/test_cli_options.py checks they match runtime/runners.RUNNERS and exporter/engine_targets.RUNTIMES);
  the `--preset` help is one text made from exporter/presets.PRESET_USES, the `--runtime` help from
  exporter/engine_targets (the GPUs each runtime's engines serve).
- Booleans are plain flags (`--chat`) or `--x/--no-x` pairs, never `--chat true`.
- `--cuda-graph` runs the torch runners (eager, pt2) on CUDA and replays repeated-shape decode steps as CUDA
  graphs (runtime/cuda_graph.py); where no graph can be captured the command is refused in one line.
- A flag that cannot apply is refused in one line, never ignored (`refuse_given` and the rules of `run`,
  `verify` and `inspect` below); whether a flag was given is click's parameter source, not its value.
- Numbers are bounded where they are parsed when no export is needed to judge them (`finite`); bounds that
  depend on the export (its traced maxima, the model's context) are checked by the library before any work.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from . import __version__
from .exporter.options import Activations, DType, ExpertFormat, KernelChoice, Target, TraceMode, Trunk, WeightSource
from .exporter.engine_targets import RUNTIME_HELP
from .exporter.presets import PRESET_HELP
from .console import fail

__all__ = ["Activations", "DType", "ExpertFormat", "KernelChoice", "Target", "TraceMode", "WeightSource"]  # torch-free


def must_exist(path: Path | None) -> Path | None:
    """Parameter callback: the path exists (one line naming it otherwise, exit 1), checked before torch loads."""
    if path is not None and not path.exists():
        fail(f"{path}: does not exist")
    return path


def finite(param: typer.CallbackParam, value: float) -> float:
    """Parameter callback: a finite number >= 0 (inf / nan / negative refused in one line naming the flag)."""
    import math

    if not (math.isfinite(value) and value >= 0):
        fail(f"{param.opts[0]} {value}: must be a finite number >= 0")
    return value


def given(ctx: typer.Context) -> set[str]:
    """The parameters the user gave (command line or environment), whatever their value."""
    sources = {n: ctx.get_parameter_source(n) for n in ctx.params}  # typer's own click: its enum, by name
    return {n for n, src in sources.items() if src is not None and src.name in ("COMMANDLINE", "ENVIRONMENT")}


def flag_name(ctx: typer.Context, name: str) -> str:
    """How the user spells parameter `name` (`--max-sequences`; an argument: its metavar)."""
    param = next(p for p in ctx.command.params if p.name == name)
    return param.opts[0] if param.opts and param.opts[0].startswith("-") else name.upper()


def refuse_given(ctx: typer.Context, names, why: str) -> None:
    """Fail (one line naming the flag) when any of `names` was given."""
    for name in names:
        if name in given(ctx):
            fail(f"{flag_name(ctx, name)}: {why}")


SERVING_FLAGS = ("prompts", "prompts_format", "max_sequences", "cache_blocks", "max_step_tokens", "json_out",
                 "prefix_cache", "prefix_cache_mb", "speculate", "draft", "speculate_tokens")


def run_rules(ctx: typer.Context, serving: bool) -> None:
    """`k3x run`: every flag given applies to this export and these flags, or the command is refused."""
    p = ctx.params
    if not serving:
        refuse_given(ctx, SERVING_FLAGS, "applies to a serving export (export --serving); this is a batch export")
    else:
        refuse_given(ctx, ["cuda_graph"], "a serving export's step is not replayed as CUDA graphs; drop it")
    if p["prompts"] is not None:
        refuse_given(ctx, ["prompt", "prompt_ids", "chat"], "not with --prompts: the requests come from the file")
    else:
        refuse_given(ctx, ["prompts_format"], "applies to --prompts FILE")
    if not p["prefix_cache"]:
        refuse_given(ctx, ["prefix_cache_mb"], "is the budget of --prefix-cache; give --prefix-cache")
    if p["draft"] is None:
        refuse_given(ctx, ["speculate_tokens"], "is the drafts per step of --draft EXPORT (ngram:K names its own)")
    if p["save_state"] is not None:
        refuse_given(ctx, ["load_state"], "give one of --save-state or --load-state (a loaded state has no prefill "
                                         "to save)")
    if p["temperature"] == 0:
        refuse_given(ctx, ["seed"], "seeds the sampler; greedy decoding (--temperature 0) draws nothing")
    if p["backend"] != Backend.ORT:
        refuse_given(ctx, ["provider"], "applies to --backend ort")


def verify_rules(ctx: typer.Context, serving: bool) -> None:
    """`k3x verify`: every flag given applies to this export, or the command is refused."""
    if serving:
        refuse_given(ctx, ["batch"], "a serving export is verified one sequence at a time; drop it")
        refuse_given(ctx, ["cuda_graph"], "a serving export's step is not replayed as CUDA graphs; drop it")
    named = [b.strip() for b in ctx.params["backends"].split(",") if b.strip()]
    if named and "ort" not in named:
        refuse_given(ctx, ["provider"], "applies to the ort backend; --backends has none")


def inspect_rules(ctx: typer.Context) -> None:
    """`k3x inspect`: the serving-pools view (--sequences) and the parallel fit (--tp/--ep) take their own flags;
    --export (an export's ONNX inputs and outputs) takes none."""
    p = ctx.params
    if p.get("export") is not None:
        refuse_given(ctx, [n for n in p if n != "export"], "does not apply with --export (an export's ONNX inputs "
                     "and outputs)")
        return
    if p["sequences"] is not None:
        refuse_given(ctx, ["json_out"], "prints one JSON object of the model summary, not of --sequences' pools")
        refuse_given(ctx, ["batch"], "is the fit table's batch (--tp/--ep); --sequences counts the sequences")
        return
    refuse_given(ctx, ["dtype", "chunk"], "applies to --sequences N (the serving pools)")
    if p["tp"] * p["ep"] == 1:
        refuse_given(ctx, ["batch", "context"], "applies to --tp/--ep (the fit table) or --sequences N")


def state_file_exists(path: Path | None) -> Path | None:
    """--load-state: the file, or rank 0's file of a state saved by rank programs (FILE.rank0of{W}), exists."""
    import glob

    if path is not None and not path.exists() and not list(path.parent.glob(glob.escape(path.name) + ".rank0of*")):
        fail(f"{path}: does not exist")
    return path


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"k3x {__version__}")
        raise typer.Exit()


class Backend(str, Enum):  # runtime/runners.RUNNERS
    ORT = "ort"
    PT2 = "pt2"
    AOTI = "aoti"
    TRT = "trt"
    EAGER = "eager"


class Provider(str, Enum):  # runtime/ort_runner: ONNX Runtime's execution provider
    AUTO = "auto"
    CUDA = "cuda"
    CPU = "cpu"


class Runtime(str, Enum):  # exporter/engine_targets.RUNTIMES + auto
    AUTO = "auto"
    TRT = "trt"
    TRT_RTX = "trt-rtx"


class PluginPath(str, Enum):
    AOT = "aot"
    JIT = "jit"


# global
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Debug lines: stages, paths, timings.")]
Version = Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                       help="Print the k3x version and exit.")]

# model sources
Preset = Annotated[Optional[str], typer.Option(help=PRESET_HELP)]  # one text for every --preset (exporter/presets.py)
Checkpoint = Annotated[Optional[Path], typer.Option(callback=must_exist,
                                                    help="Checkpoint folder (config.json + safetensors).")]
CheckpointRequired = Annotated[Path, typer.Option("--checkpoint", callback=must_exist, help="Checkpoint folder.")]
ExportDir = Annotated[Path, typer.Argument(callback=must_exist, help="Export folder (k3x export).")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]

# init-checkpoint
InitPreset = Annotated[str, typer.Option("--preset", help=PRESET_HELP)]
InitOut = Annotated[Path, typer.Option("--out", help="Folder to create (must not exist or be empty).")]
WeightSeed = Annotated[int, typer.Option("--seed", help="Random seed of the weights.")]
InitExperts = Annotated[ExpertFormat, typer.Option("--expert-format",
                                                   help="mxfp4 (as the real K3 checkpoint) or dense.")]
Tokenizer = Annotated[bool, typer.Option("--tokenizer/--no-tokenizer", help="Also write a small byte-level BPE "
                                         "tokenizer trained at init (text in and out with --prompt).")]

# parallel plan (export, inspect)
TP = Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel ranks (attention heads, FFN, vocab).")]
EP = Annotated[int, typer.Option("--ep", min=1, help="Expert-parallel ranks (routed experts).")]
FitBatch = Annotated[int, typer.Option("--batch", min=1, help="inspect --tp/--ep: sequences for the fit table.")]
FitContext = Annotated[int, typer.Option("--context", min=1, help="inspect --tp/--ep: tokens per sequence.")]

InspectExport = Annotated[Optional[Path], typer.Option(
    "--export", callback=must_exist, help="An export folder: each ONNX file's inputs and outputs (name, dtype, "
                                          "shape) from its manifest, for your own ONNX Runtime loop.")]

# export
ExportOut = Annotated[Path, typer.Option("--out", help="Export folder (created; each artifact renamed into place).")]
Targets = Annotated[list[Target], typer.Option("--target", help="Artifact(s) to build from the one trace "
                                               "(repeatable).")]
NoWeights = Annotated[bool, typer.Option("--no-weights", help="Trace on the meta device: any size, no weights.")]
WeightsFrom = Annotated[WeightSource, typer.Option(
    "--weights", help="With --checkpoint: copy the weights into the pt2 / ONNX (default), or reference the "
    "checkpoint: graph-only artifacts, the weights read (and the checkpoint's files checked) at load.")]
ModelDType = Annotated[DType, typer.Option("--dtype", help="Model dtype (states stay fp32): auto = the checkpoint's "
                                           "(config.json torch_dtype, else its safetensors'; float16 -> fp32) or the "
                                           "preset's default; the export prints what it chose. A bf16 model.onnx needs "
                                           "ONNX Runtime's CUDA provider: --dtype fp32 to run it on a CPU.")]
PoolDType = Annotated[DType, typer.Option("--dtype", help="inspect --sequences: the model dtype of the MLA latents "
                                          "(auto: what export --dtype auto picks).")]
PresetSeed = Annotated[int, typer.Option("--seed", help="Seed of a preset's random weights.")]
Kernels = Annotated[KernelChoice, typer.Option(
    "--kernels", help="k3 custom-op implementation traced into the program: reference (PyTorch, any device) or "
                      "triton (Triton kernels, CUDA only). Not the runner: that is `k3x run --backend`.")]
Experts = Annotated[Optional[ExpertFormat], typer.Option("--expert-format", help="mxfp4 (packed) or dense experts.")]
ExpertActivations = Annotated[Activations, typer.Option(
    "--activations", help="What the expert GEMMs are fed: bf16 (the activations as computed) or mxfp8 (rounded "
    "through OCP MXFP8, E4M3 with one E8M0 scale per 32: W4A8 as K3 was trained; needs MXFP4 experts). Recorded "
    "in the manifest.")]
TrunkForm = Annotated[Trunk, typer.Option(
    "--trunk", help="The dense projections' weights (attention, MLPs, shared experts, lm_head): dense (the export's "
    "dtype), bf16 or int8 (8-bit, per block of 32), both with fp32 activations: the CPU trunks ONNX Runtime runs "
    "on its CPU provider (ort flavor only). Recorded in the manifest.")]
MaxContext = Annotated[Optional[int], typer.Option(
    "--max-context", min=1, help="Static MLA latent cache: preallocate this many positions (one shape per decode "
    "step, so decode can be a CUDA graph); longer requests are refused. Default: a cache that grows each step.")]
TraceModes = Annotated[TraceMode, typer.Option(
    "--trace-mode", help="stamped: each distinct decoder layer traced once and copied for every layer (same program); "
         "per-layer: every layer traced. The manifest's `trace` says which was used.")]
OnnxFunctions = Annotated[bool, typer.Option(
    "--onnx-functions/--no-onnx-functions", help="ONNX: each decoder-layer kind one local function, called once per "
    "layer (smaller files); the flat graph where the layers do not fit. The manifest's onnx `layer_functions` says "
    "which each flavor file holds. ONNX Runtime inlines the calls when it opens a session (measured on k3-bench: "
    "about 20 % slower to open); --no-onnx-functions for the fastest session.")]

# build-engine
EngineExportDir = Annotated[Path, typer.Argument(callback=must_exist, help="Export folder holding model.trt.onnx.")]
ProfileMin = Annotated[Optional[list[str]], typer.Option("--min", help="Profile min, e.g. batch=1 (repeatable).")]
ProfileOpt = Annotated[Optional[list[str]], typer.Option("--opt", help="Profile opt, e.g. seq=128.")]
ProfileMax = Annotated[Optional[list[str]], typer.Option("--max", help="Profile max, e.g. batch=8.")]
SM = Annotated[Optional[int], typer.Option("--sm", help="Target SM (default 90 for trt, 89 for trt-rtx); one the "
                                           "runtime cannot build is refused before any work.")]
EngineRuntime = Annotated[Runtime, typer.Option("--runtime", help=RUNTIME_HELP)]
Plugins = Annotated[PluginPath, typer.Option("--plugin-path", help="aot (embedded cubins) | jit (Triton via torch).")]
StripWeights = Annotated[bool, typer.Option("--strip-weights", help="Weight-stripped plan: the runner refits its "
                                            "weights at load from the export's ONNX data (sources in the metadata).")]

# decoding (generate, run)
PromptIds = Annotated[Optional[str], typer.Option("--prompt-ids", help="Comma-separated prompt token ids "
                                                  "(default 1,2,3).")]
PromptText = Annotated[Optional[str], typer.Option("--prompt", help="Prompt text (needs a tokenizer in the folder).")]
Chat = Annotated[bool, typer.Option("--chat", help="Wrap --prompt in the tokenizer's chat template.")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", min=1, help="Most tokens to generate (stops earlier "
                                           "on EOS).")]
Temperature = Annotated[float, typer.Option("--temperature", help="0 = greedy (default); > 0 samples at this "
                                            "temperature.")]
TopK = Annotated[int, typer.Option("--top-k", min=0, help="Sample among the k most likely tokens (0 = off).")]
TopP = Annotated[float, typer.Option("--top-p", help="Sample among the smallest set of tokens whose probability sum "
                                     "reaches this (1 = off).")]
SamplerSeed = Annotated[Optional[int], typer.Option("--seed", help="Seed of the sampler (default: random); with "
                                                    "--temperature > 0 only.")]

# runners (run, verify, logits)
RunBackend = Annotated[Backend, typer.Option("--backend", help="Runner: ort, pt2, aoti, trt or eager.")]
Backends = Annotated[str, typer.Option("--backends", help="Comma-separated runners to check against eager (default: "
                                       "every backend the export has; trt only with a CUDA GPU).")]
OrtProvider = Annotated[Provider, typer.Option("--provider", help="ONNX Runtime provider: auto (CUDA if it "
                                               "initialises), cuda, cpu.")]
SkipHashCheck = Annotated[bool, typer.Option("--skip-hash-check", help="Do not sha256 the artifact files before "
                                             "loading (huge files; paths and sizes are still checked).")]
CudaGraph = Annotated[bool, typer.Option(
    "--cuda-graph", help="CUDA only: run on the GPU and replay decode steps as CUDA graphs (torch runners, aoti "
                         "packages compiled for CUDA, trt). Hybrid models replay only with a static latent "
                         "cache (export --max-context).")]

# logits
LogitsOut = Annotated[Path, typer.Option("--out", help="Where to write float32 logits [B, T, vocab] (.npy).")]
InputIds = Annotated[Optional[str], typer.Option("--input-ids", help="Comma-separated token ids (batch of one).")]
BatchFile = Annotated[Optional[Path], typer.Option("--batch-file", callback=must_exist,
                                                   help=".npy int array [B, T] of token ids.")]
LogitsBackend = Annotated[Backend, typer.Option("--backend", help="eager (from --checkpoint), or pt2 / ort (from "
                                                "--export-dir).")]
LogitsExportDir = Annotated[Optional[Path], typer.Option("--export-dir", callback=must_exist,
                                                         help="Export folder (backends pt2, ort).")]

# verify
Steps = Annotated[int, typer.Option("--steps", min=0, help="Decode steps after the prefill.")]
PromptLen = Annotated[int, typer.Option("--prompt-len", min=1, help="Prompt length of the prefill.")]
Batch = Annotated[int, typer.Option("--batch", min=1, help="Batch size.")]
PromptSeed = Annotated[int, typer.Option("--seed", help="Seed of the random prompt.")]
ReferenceCheckpoint = Annotated[Optional[Path], typer.Option("--checkpoint", callback=must_exist, help="Eager "
                                                             "reference checkpoint (default: the export's).")]
JsonReport = Annotated[Optional[Path], typer.Option("--json", help="Also write the report as JSON.")]
SaveState = Annotated[Optional[Path], typer.Option(
    "--save-state", help="Write the sequence's state after the prefill to this file (safetensors; --max-new-tokens "
                         "1 stops there), for --load-state in another process. Rank programs (a serving export): "
                         "each rank writes its own, FILE.rank{r}of{W}.")]
LoadState = Annotated[Optional[Path], typer.Option(
    "--load-state", callback=state_file_exists,
    help="Decode from a state file of --save-state (its sequence; no prompt), checked against this export's state "
         "contract (rank programs: each rank its own FILE.rank{r}of{W}, of the same plan).")]

# serving (many prompts through one runtime: `run --prompts FILE`)
PromptsFile = Annotated[Optional[Path], typer.Option(
    "--prompts", help="Serving export: a file of requests, one a line, served together by continuous batching. "
                      "A .jsonl file (or --prompts-format jsonl): JSON lines, {\"prompt\": \"text\"} or "
                      "{\"prompt_ids\": [1, 2, 3]}, optionally \"max_tokens\" (and temperature / top_p / top_k "
                      "/ seed, equal to the run's). Any other file: each line is text, always (token ids only "
                      "in .jsonl).")]
PromptsFormat = Annotated[Optional[str], typer.Option(
    "--prompts-format", help="text | jsonl: the format of --prompts (default: jsonl for a .jsonl file, else text).")]
MaxSequences = Annotated[int, typer.Option(min=1, help="Serving: sequences in flight (state slots).")]
CacheBlocks = Annotated[Optional[int], typer.Option(
    min=1, help="Serving: MLA latent cache blocks (default: enough for --max-sequences of the longest requests).")]
MaxStepTokens = Annotated[int, typer.Option(min=1, help="Serving: tokens per step; longer prompts are prefilled "
                                                        "in chunks.")]
PrefixCache = Annotated[bool, typer.Option("--prefix-cache", help="Serving: reuse cached prompt prefixes "
                                           "(linear-attention state snapshots at block boundaries, shared latent "
                                           "blocks); reports the hit rate and the prefill tokens saved.")]
PrefixCacheMB = Annotated[float, typer.Option("--prefix-cache-mb", callback=finite, help="--prefix-cache: memory budget in MB "
                                              "(snapshots + blocks only the cache holds; least recently used "
                                              "evicted first).")]
JsonOut = Annotated[Optional[Path], typer.Option("--json", help="Serving: write one record per prompt (input "
                                                                "order: tokens and text) to this file.")]
Speculate = Annotated[Optional[str], typer.Option(
    "--speculate", help="Serving: speculative decoding from prompt n-grams, ngram:K (K draft tokens per step; "
                        "greedy only, the same tokens).")]
Draft = Annotated[Optional[Path], typer.Option(
    "--draft", help="Serving: speculative decoding with drafts from this serving export (a small model of the "
                    "same vocabulary; greedy only, the same tokens).")]
SpeculateTokens = Annotated[int, typer.Option(min=1, help="--draft: draft tokens per step.")]
Sequences = Annotated[Optional[int], typer.Option(
    min=1, help="Serving pools: the memory of this many sequences of --context positions (latents in --dtype, "
                "block 16; per rank with --tp/--ep).")]
StepChunk = Annotated[Optional[int], typer.Option(
    "--chunk", min=1, help="--sequences: also the working memory of one serving step of this many tokens (a prefill "
                           "chunk, --max-step-tokens) and the peak it implies (pools + step).")]
Serving = Annotated[bool, typer.Option("--serving", help="Trace the serving step (packed sequences, state pools, "
                                                         "continuous batching) instead of the batch interface.")]
BlockSize = Annotated[int, typer.Option(min=1, help="--serving: positions per MLA latent block.")]

# serve (an OpenAI-compatible server over a serving export)
ServeBackend = Annotated[Backend, typer.Option("--backend", help="Runner of the serving step: ort, pt2, aoti or trt.")]
Host = Annotated[str, typer.Option("--host", help="Address to listen on (default: this machine only; 0.0.0.0 "
                                                  "for every interface).")]
Port = Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port (0: any free one, printed).")]
ApiKey = Annotated[Optional[str], typer.Option(
    "--api-key", envvar="K3X_API_KEY", show_envvar=True,
    help="Require `Authorization: Bearer KEY` on every route but /health.")]
ServedModelName = Annotated[Optional[str], typer.Option(
    "--served-model-name", help="The model name clients give (default: the export folder's name).")]
MaxQueue = Annotated[int, typer.Option("--max-queue", min=0, help="Requests that may wait for a slot; past it 503 "
                                                                  "with Retry-After.")]
DrainTimeout = Annotated[float, typer.Option("--drain-timeout", min=0, help="On SIGTERM / SIGINT: seconds the "
                                             "requests in flight may take to finish (new ones get 503).")]
ServeCacheBlocks = Annotated[Optional[int], typer.Option(
    "--cache-blocks", min=1, help="MLA latent cache blocks (default: every slot at 8,192 positions, or the "
                                  "context if shorter); a request that can never fit is refused.")]
