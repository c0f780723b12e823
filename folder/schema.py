"""The manifest's fixed points, shared by the writer (folder/artifacts.py) and the checker
(folder/trust.py): the file name, the schema version, the export dtypes and the one error type."""

from __future__ import annotations

import torch

from ..plan.dtypes import FLOAT, torch_dtype

MANIFEST = "manifest.json"
SCHEMA = 1
DTYPES: dict[str, torch.dtype] = {n: torch_dtype(n) for n in FLOAT}  # the export dtypes (plan/dtypes.py)


class ManifestError(RuntimeError):
    """A manifest is missing, unreadable or lacks what was asked of it; the message names the file."""
