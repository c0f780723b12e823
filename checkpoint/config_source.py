"""The architecture a command works on: a preset by name, or a checkpoint folder's config.json."""

from __future__ import annotations

from pathlib import Path

from ..model.config import ConfigError, K3Config, preset
from .files import checkpoint_file
from .hf_config import config_from_hf


def config_of(preset_name: str | None, checkpoint: Path | None) -> K3Config:
    """The config of exactly one of a preset name or a checkpoint folder (its config.json). ConfigError /
    CheckpointError (one line) otherwise."""
    if (preset_name is None) == (checkpoint is None):
        raise ConfigError("give exactly one of --preset NAME or --checkpoint DIR")
    return preset(preset_name) if preset_name else config_from_hf(checkpoint_file(checkpoint, "config.json"))
