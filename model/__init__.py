"""The K3 architecture in PyTorch: config, layers, state and checkpoints."""

from .config import PRESETS, ConfigError, K3Config, preset
from .init import build_model
from .model import K3ForCausalLM
from .state import empty_state, state_specs

__all__ = ["PRESETS", "ConfigError", "K3Config", "K3ForCausalLM", "build_model", "empty_state", "preset",
           "state_specs"]
