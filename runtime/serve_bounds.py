"""The bounds of a serving run (`k3x run --prompts` / a serving export), checked before anything is loaded or
allocated, as runners.check_request checks a batch request: the deployment flags against the maxima the
export's step was traced for (manifest `serving.dims`: slots, seqs, tokens, blocks, table_blocks), and every
request's positions (prompt + new tokens - 1) against the model's context. Each error is one RunnerError line
naming the flag (or the prompt's file and line) and the limit, so `--max-sequences 10**12` never builds a free
list and a 20,000-token prompt never reaches a 4,096-context model.
"""

from __future__ import annotations

from dataclasses import dataclass

from .runners import RunnerError


@dataclass(frozen=True)
class Served:
    """One request as the user gave it: its ids, its new tokens and where it came from (`--prompts F:3`)."""
    ids: list[int]
    new_tokens: int
    where: str
    new_flag: str  # what set its new tokens: --max-new-tokens, or the line's max_tokens


def traced_max(entry: dict, dim: str) -> int:
    """The traced maximum of a serving dim (manifest `serving.dims`; the exporter's table for older folders)."""
    dims = entry.get("dims")
    if isinstance(dims, dict) and isinstance(dims.get(dim), dict) and isinstance(dims[dim].get("max"), int):
        return dims[dim]["max"]
    from ..exporter.serving import SERVING_DIMS

    return SERVING_DIMS[dim][2]


def check_serving(entry: dict, cfg, options, requests: list[Served], draft_tokens: int = 0) -> None:
    """Refuse a serving run the export cannot take (`options`: runtime/serve.ServeOptions; `draft_tokens`:
    the drafts per step of --speculate / --draft)."""
    sequences = min(traced_max(entry, "seqs"), traced_max(entry, "slots"))
    if options.max_sequences > sequences:
        raise RunnerError(f"--max-sequences {options.max_sequences}: over this export's maximum of {sequences} "
                          "sequences (traced serving dims seqs / slots)")
    tokens = traced_max(entry, "tokens")
    if options.max_step_tokens > tokens:
        raise RunnerError(f"--max-step-tokens {options.max_step_tokens}: over this export's maximum of {tokens} "
                          "tokens per step")
    if draft_tokens >= options.max_step_tokens:
        raise RunnerError(f"--speculate / --speculate-tokens {draft_tokens}: drafts per step must be under "
                          f"--max-step-tokens {options.max_step_tokens}")
    blocks = traced_max(entry, "blocks")
    if options.cache_blocks is not None and options.cache_blocks > blocks:
        raise RunnerError(f"--cache-blocks {options.cache_blocks}: over this export's maximum of {blocks} blocks")
    context, table = cfg.max_position_embeddings, traced_max(entry, "table_blocks") * options.block_size
    for r in requests:
        positions = len(r.ids) + r.new_tokens - 1
        if len(r.ids) > context:
            raise RunnerError(f"{r.where}: {len(r.ids):,} prompt tokens, over the model's context of {context:,} "
                              "(max_position_embeddings)")
        if positions > context:
            raise RunnerError(f"{r.new_flag} {r.new_tokens:,}: {r.where} ({len(r.ids):,} tokens) + "
                              f"{r.new_tokens - 1:,} decode steps = {positions:,} positions, over the model's "
                              f"context of {context:,} (max_position_embeddings)")
        if positions > table:
            raise RunnerError(f"{r.where}: {positions:,} positions, over this export's maximum of {table:,} per "
                              "sequence (traced table_blocks x block size)")
