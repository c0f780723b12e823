"""Commands on a model before any export: `init-checkpoint` (a random-weight checkpoint in the Hugging Face
format) and `inspect` (layer plan, parameters, cache sizes; with --tp/--ep the per-rank fit)."""

from __future__ import annotations

import json
from pathlib import Path

from .app import app
from .console import debug, echo, timed
from .options import EP, TP, Checkpoint, FitBatch, FitContext, InitExperts, InitOut, InitPreset, Json, \
    DType, ExpertFormat, PoolDType, Preset, Sequences, StepChunk, Tokenizer, WeightSeed


@app.command("init-checkpoint")
def init_checkpoint(preset: InitPreset = "k3-mini", out: InitOut = Path("k3-mini-ckpt"), seed: WeightSeed = 0,
                    expert_format: InitExperts = ExpertFormat.MXFP4, tokenizer: Tokenizer = True) -> None:
    """Write a random-weight checkpoint in the real Hugging Face format (config.json + safetensors). Its
    weights are random: generated text is gibberish (the pipeline, not the model, is what it tests)."""
    from ..checkpoint.random_init import init_checkpoint as write

    with timed(f"init-checkpoint {out}"):
        cfg = write(preset, out, seed=seed, expert_format=expert_format.value, tokenizer=tokenizer)
    echo(f"wrote {cfg.name} checkpoint (seed {seed}, experts {expert_format.value}"
         + (", tokenizer" if tokenizer else "") + f") to {out}")


@app.command()
def inspect(preset: Preset = None, checkpoint: Checkpoint = None, json_out: Json = False, tp: TP = 1, ep: EP = 1,
            batch: FitBatch = 1, context: FitContext = 131072, sequences: Sequences = None,
            dtype: PoolDType = DType.BF16, chunk: StepChunk = None) -> None:
    """Layer plan, total/active parameters, cache sizes, bytes by storage format (meta device: no weights);
    with --tp/--ep: per-rank bytes, collective bytes and the fit on H200 / B200 / GB300."""
    from ..checkpoint.config_source import config_of
    from ..model.parallel_budget import budget, format_budget
    from ..model.summary import format_summary, summarize

    cfg = config_of(preset, checkpoint)
    debug("config %s (hash %s) from %s", cfg.name, cfg.hash()[:12], checkpoint or f"preset {preset}")
    if sequences is not None:  # serving pools (cli/serve.py)
        from .serve import print_pools

        return print_pools(cfg, context, sequences, tp=tp, ep=ep, dtype=dtype.value, chunk=chunk)
    with timed("inspect"):
        if tp * ep > 1:
            from ..model.parallel import ParallelPlan

            s = budget(cfg, ParallelPlan(tp, ep), batch=batch, context=context)
        else:
            s = summarize(cfg)
    echo(json.dumps(s) if json_out else (format_budget if tp * ep > 1 else format_summary)(s))
