"""A checkpoint's eager model as `k3x generate` and `k3x logits` run it (no export folder): the request
checked first, then the model loaded; `generate` on the CPU, or on CUDA through a graphed runner with a
static latent cache of prompt + new tokens positions (every decode step one shape)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..checkpoint.files import load_checkpoint
from ..checkpoint.config_source import config_of
from ..model.model import K3ForCausalLM
from ..model.options import CacheOptions
from ..text.sampling import Generation, SamplingOptions
from .generate import full_logits, generate as plain_generate
from .runners import ModuleRunner, RunnerError, check_request, generate


def load_for(checkpoint: Path, *, batch: int, prompt_len: int, new_tokens: int) -> K3ForCausalLM:
    """The checkpoint's model (fp32, CPU), after the request is checked against its config (RunnerError)."""
    check_request(config_of(None, checkpoint), batch=batch, prompt_len=prompt_len, new_tokens=new_tokens)
    return load_checkpoint(checkpoint)


def eager_generate(model: K3ForCausalLM, prompt: torch.Tensor, options: SamplingOptions,
                   on_token: Callable | None, cuda_graph: bool) -> Generation:
    """Decode with the eager model; `cuda_graph`: on CUDA, decode steps replayed as CUDA graphs (RunnerError,
    one line, where CUDA is missing)."""
    if not cuda_graph:
        return plain_generate(model, prompt, options, on_token=on_token)
    from .cuda_graph import require_cuda_graph

    cfg = model.cfg
    cache = CacheOptions(min(prompt.shape[1] + options.max_new_tokens, cfg.max_position_embeddings))
    runner = require_cuda_graph(ModuleRunner("eager", model, cfg, "cuda", cache), "generate")  # refused without CUDA
    model.to("cuda")
    return generate(runner, cfg, prompt, options, dtype=model.model.embed_tokens.weight.dtype, on_token=on_token,
                    cache=cache)


def checkpoint_logits(checkpoint: Path, ids: torch.Tensor) -> torch.Tensor:
    """float32 logits [B, T, vocab] of the checkpoint's model on `ids` [B, T] (RunnerError: one line)."""
    model = load_for(checkpoint, batch=ids.shape[0], prompt_len=ids.shape[1], new_tokens=1)
    try:
        return full_logits(model, ids)
    except (ValueError, RuntimeError) as e:
        raise RunnerError(f"eager: {type(e).__name__}: {str(e).strip()[:300]}") from None
