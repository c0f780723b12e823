"""Continuous batching over any serving-step runner: prompts in, one record per prompt out (input order).

    runner = StepModuleRunner("eager", K3ServingStep(model, kernels="reference"))
    records = serve(runner, cfg, prompts, SamplingOptions(max_new_tokens=8), ServeOptions(max_sequences=4))

The scheduler (runtime/scheduler.py) packs each step; the pools (runtime/pools.py) are fed to the runner by
name every step (the same tensors: a runner that binds them does not copy) and the step's new rows are
written back in place; a runner that binds outputs writes the KDA rows into the pools itself when it can
(runtime/step_outputs.py). Tokens are chosen by the shared sampler (text/sampling.py), one `Sampler` per prompt
(seeded `seed + index`), so a prompt's tokens do not depend on what it was batched with.
`ServeOptions.prefix_cache`: prompts sharing a prefix start from its KDA snapshot and shared latent blocks
(runtime/prefix_cache.py); `Record.cached` says how many prompt tokens each took from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
from torch import Tensor

from ..model.serving import STEP_INPUTS
from ..model.state import state_bytes
from ..text.sampling import Sampler, SamplingOptions
from .base import Feeds, torch_threads_for
from .engine import Engine, EngineSizes
from .scheduler import Request
from .speculate import Counts



@dataclass(frozen=True)
class ServeOptions:
    max_sequences: int = 8  # slots: sequences in flight
    cache_blocks: int | None = None  # MLA latent blocks; None = enough for every slot at its longest request
    block_size: int = 16  # fixed at export for exported steps (manifest `serving.block_size`)
    max_step_tokens: int = 512  # tokens per step (prompts longer than this are prefilled in chunks)
    keep_logits: bool = False  # records carry the logits every token was chosen from (tests, verify)
    prefix_cache: bool = False  # reuse cached prompt prefixes (KDA snapshots + shared latent blocks)
    prefix_cache_bytes: int = 1 << 30  # the cache's memory budget (snapshots + blocks only it holds), LRU


@dataclass
class Record:
    index: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logits: list[Tensor] = field(default_factory=list)  # [vocab] fp32 per token (ServeOptions.keep_logits)
    cached: int = 0  # prompt tokens restored from the prefix cache (not prefilled)
    counts: Counts = field(default_factory=Counts)  # steps that gave it tokens; drafts (speculation)


@dataclass(frozen=True)
class SlotState:
    """One sequence's state in a deployment (a state file's content, runtime/state_file.py): the tokens it
    holds, its slot's KDA rows and its latent rows by pool name (`pool.{i}.conv` [3P, W-1], `.recurrent`
    [H, K, V], `.latent` [T, kv_lora + rope]), and its last position's logits [vocab] fp32."""
    tokens: list[int]
    rows: dict[str, Tensor]
    logits: Tensor


class StepModuleRunner:
    """A serving step as a module (K3ServingStep, an ExportedProgram's module): flat feeds -> named outputs."""

    def __init__(self, name: str, module: Callable, input_names: Sequence[str], output_names: Sequence[str],
                 device: str | None = None) -> None:
        self.name, self.module, self.device = name, module, device
        self.input_names, self.output_names = list(input_names), list(output_names)

    @torch.no_grad()
    def infer(self, feeds: Feeds) -> Feeds:
        args = [feeds[n] if self.device is None else feeds[n].to(self.device) for n in self.input_names]
        logits, new = self.module(*args[: len(STEP_INPUTS)], args[len(STEP_INPUTS):])
        return dict(zip(self.output_names, [logits, *new]))


def serving_runner(backend: str, export_dir, options=None):
    """The runner of a serving export (`k3x export --serving`): pt2 (the step program's module), aoti (its
    AOTInductor package), ort (the ort flavor through IO binding) or trt (the engine of `k3x build-engine`:
    TensorRT 11 and a GPU); ort and trt bind the pools by pointer, no copy per step on the runner's device.
    pt2 and aoti take the pools by position: the manifest's order is the program's own (`serving_entry`), and
    the pt2 program's signature has as many inputs."""
    from .runners import (RunnerError, RunnerOptions, load_aoti_artifact, load_pt2_artifact, make_runner, open_folder,
                          serving_entry)

    options = options or RunnerOptions()
    folder = open_folder(export_dir)
    entry = serving_entry(folder)
    if backend in ("ort", "trt"):
        return make_runner(backend, folder, options)
    if backend == "aoti":
        package, device = load_aoti_artifact(folder, options)
        return StepModuleRunner("aoti", package, entry["inputs"], entry["outputs"], device)
    if backend != "pt2":
        raise RunnerError(f"backend={backend!r}: a serving export runs on pt2, aoti, ort or trt")
    ep = load_pt2_artifact(folder, options, "the serving step")
    takes = list(ep.graph_signature.user_inputs)  # the program's own signature: the step inputs, then pools_0...
    if len(takes) != len(entry["inputs"]) or takes[: len(STEP_INPUTS)] != list(STEP_INPUTS):
        raise RunnerError(f"{folder.path}: the step program takes {len(takes)} inputs ({', '.join(takes[:8])[:120]}), "
                          f"the manifest's serving.inputs lists {len(entry['inputs'])}; refused")
    return StepModuleRunner("pt2", ep.module(), entry["inputs"], entry["outputs"], options.device)


def default_blocks(requests: list[Request], options: ServeOptions, cfg, dtype: torch.dtype) -> int:
    """Enough blocks for the `max_sequences` longest requests at once (nothing waits for memory), plus, with
    the prefix cache, what its budget holds (at most every prompt's blocks)."""
    need = sorted((-(-r.positions // options.block_size) for r in requests), reverse=True)
    blocks = max(1, sum(need[: options.max_sequences]))
    if options.prefix_cache:
        per_block = state_bytes(cfg, torch.empty((), dtype=dtype).element_size())["mla_kv_bytes_per_token"]
        blocks += min(options.prefix_cache_bytes // (per_block * options.block_size),
                      sum(len(r.prompt) // options.block_size for r in requests))
    return blocks


def serve(runner, cfg, prompts: Sequence[Sequence[int]], sampling: SamplingOptions,
          options: ServeOptions = ServeOptions(), *, max_new_tokens: Sequence[int] | None = None,
          dtype: torch.dtype = torch.float32, device: str | None = None, pool_cfg=None,
          agree: Callable[[list[int]], list[int]] | None = None, stats: dict | None = None, drafter=None,
          resume: dict[int, SlotState] | None = None, on_prefill: Callable[[int, SlotState], None] | None = None
          ) -> list[Record]:
    """Generate for every prompt (ids) -> records in input order. `max_new_tokens`: per prompt (default:
    sampling.max_new_tokens for all). The pools live on `device`, by default the runner's (an ORT CUDA session
    then binds them where they are: a pool on another device would be copied every step).
    Rank programs: `cfg` is the whole model's (token ids), `pool_cfg` the rank program's (its pools: its KDA
    heads, the whole latent), and `agree` makes each step's chosen tokens the same on every rank
    (runtime/dist_run.agree_tokens), so every rank's scheduler makes the same steps. `stats`: a dict the
    run's counters are added to (the prefix cache's figures). `drafter`: speculative decoding
    (runtime/speculate.py; greedy only; on rank programs every rank takes rank 0's drafts and
    tokens), the same tokens in fewer steps. `resume`: prompt i starts from a saved state (its prompt is the
    state's tokens; its first token is chosen from the saved logits, on rank programs rank 0's);
    `on_prefill(i, state)`: called with prompt i's state once its prompt is in (a state file)."""
    if drafter is not None and not sampling.greedy:
        raise ValueError(f"temperature={sampling.temperature}: speculative decoding is greedy only (temperature 0)")
    news = list(max_new_tokens) if max_new_tokens is not None else [sampling.max_new_tokens] * len(prompts)
    if len(news) != len(prompts):
        raise ValueError(f"max_new_tokens: {len(news)} values for {len(prompts)} prompts")
    requests = [Request(i, tuple(int(t) for t in p), n) for i, (p, n) in enumerate(zip(prompts, news))]
    sizes = EngineSizes(options.max_sequences, options.cache_blocks or default_blocks(requests, options, cfg, dtype),
                        options.block_size, options.max_step_tokens,
                        options.prefix_cache_bytes if options.prefix_cache else None)
    engine = Engine(runner, cfg, sizes, eos_token_ids=sampling.eos_token_ids, dtype=dtype, device=device,
                    pool_cfg=pool_cfg, agree=agree, drafter=drafter)
    records = [Record(r.id, list(r.prompt)) for r in requests]
    seed = sampling.seed
    samplers = [Sampler(replace(sampling, seed=None if seed is None else seed + i)) for i in range(len(requests))]
    resume = resume or {}
    if resume and options.prefix_cache:
        raise ValueError("--prefix-cache with --load-state: a resumed sequence starts from its own state")
    if on_prefill is not None:
        def prefilled(rid: int, row: Tensor) -> None:
            prompt = list(requests[rid].prompt)
            saved = engine.pools.save_sequence(engine.alloc.slot_of[rid], engine.alloc.table_of[rid], len(prompt))
            on_prefill(rid, SlotState(prompt, saved, row.cpu()))
        engine.on_prefill = prefilled
    for r in requests:
        if r.id in resume:
            _resume(records[r.id], resume[r.id], samplers[r.id], options.keep_logits, agree)
        if r.id not in resume or not _finished(records[r.id], r, sampling.eos_token_ids):
            engine.add(r, samplers[r.id], records[r.id].tokens if r.id in resume else None,
                       resume[r.id].rows if r.id in resume else None)
    with torch_threads_for(runner, getattr(drafter, "runner", None)):  # a model drafter has its own runner
        while not engine.idle:
            for e in engine.step():
                rec = records[e.rid]
                if e.error is not None:
                    raise ValueError(f"prompt {e.rid}: {e.error}")
                rec.tokens += e.tokens
                rec.logits += [r.cpu() for r in e.rows] if options.keep_logits else []
                rec.counts.add(Counts(e.drafted, e.accepted, len(e.tokens), 1))
            for rid in engine.admitted:
                records[rid].cached = engine.cached.get(rid, 0)
    if stats is not None and engine.prefix is not None:
        stats.update(engine.prefix.figures())
    return records


def _resume(record: Record, state: SlotState, sampler: Sampler, keep_logits: bool, agree=None) -> None:
    """A resumed prompt's first token, chosen from its saved logits as its prefill step would have (rank
    programs, `agree`: rank 0's, as every step's)."""
    record.tokens = [int(sampler(state.logits.float()[None])[0])]
    if agree is not None:
        record.tokens = agree(record.tokens)
    record.logits = [state.logits] if keep_logits else []


def _finished(record: Record, request: Request, eos: tuple[int, ...]) -> bool:
    return len(record.tokens) >= request.max_new_tokens or record.tokens[-1] in eos
