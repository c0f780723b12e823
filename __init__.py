"""k3x: compiled graph export pipeline for Kimi-K3-architecture models."""

__version__ = "0.1.0"
