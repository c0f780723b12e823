"""Tiny helpers shared by the references and the model (torch-only)."""

from __future__ import annotations

import torch
from torch import Tensor


def cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in `dtype`; no graph node when it already is (casts are a third of an exported graph otherwise)."""
    return x if x.dtype == dtype else x.to(dtype)
