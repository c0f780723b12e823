"""A random-weight checkpoint of a preset in the Hugging Face format (`k3x init-checkpoint`): config.json,
safetensors shards and, unless asked not to, a small byte-level BPE tokenizer. Its weights are random, so
the text it generates is gibberish: it tests the pipeline, not the model."""

from __future__ import annotations

from pathlib import Path

from ..model.config import K3Config, preset
from ..model.init import build_model
from ..text.tiny_tokenizer import tokenizer_files
from .files import CheckpointError
from .save import save_checkpoint


def init_checkpoint(preset_name: str, out: Path, *, seed: int = 0, expert_format: str = "mxfp4",
                    tokenizer: bool = True) -> K3Config:
    """A random-weight checkpoint of the preset written to `out` (`k3x init-checkpoint`), with a small
    byte-level BPE tokenizer unless `tokenizer` is False. CheckpointError (one line) when it cannot be written."""
    cfg = preset(preset_name)
    try:
        extra = tokenizer_files(cfg.vocab_size) if tokenizer else None
        save_checkpoint(build_model(cfg, seed=seed), out, expert_format=expert_format, extra_files=extra)
    except (ValueError, OSError) as e:
        raise CheckpointError(str(e)) from None
    return cfg
