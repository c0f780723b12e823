"""`k3x logits`'s input and output: token ids from a bounded `.npy` file, full-sequence logits of an exported
artifact (one prefill from an empty state), and the logits written atomically as `.npy`.

`read_ids_npy` reads the `.npy` header first: no `.npz`, no pickles, no header promising more bytes than the
file holds (a header claiming 8 TiB is refused before numpy allocates). Errors are RunnerError, one line
naming the file.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from ..fileio import write_output
from ..folder.artifacts import ExportFolder
from .runners import RunnerError, RunnerOptions, check_request, make_runner, prefill_logits


def read_ids_npy(path: Path) -> np.ndarray:
    """A .npy integer array [B, T], its header checked before any data is read."""
    try:
        with open(path, "rb") as f:
            if f.read(4).startswith(b"PK"):
                raise RunnerError(f"{path}: a .npz archive; --batch-file takes one .npy array [B, T] (np.save, "
                                  "not np.savez)")
            f.seek(0)
            version = np.lib.format.read_magic(f)
            shape, _, dtype = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)(f)
            header_end = f.tell()
        size = path.stat().st_size
    except (OSError, ValueError) as e:
        raise RunnerError(f"{path}: cannot read a .npy array ({str(e)[:200]})") from None
    if len(shape) != 2 or dtype.kind not in "iu":
        raise RunnerError(f"{path}: expected an integer array [B, T], got {dtype} {list(shape)}")
    if shape[0] * shape[1] * dtype.itemsize != size - header_end:
        raise RunnerError(f"{path}: the header says {dtype} {list(shape)} ({shape[0] * shape[1] * dtype.itemsize:,} "
                          f"bytes), the file holds {size - header_end:,}")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise RunnerError(f"{path}: cannot read a .npy array ({str(e)[:200]})") from None


def export_logits(folder: ExportFolder, backend: str, ids: torch.Tensor, options: RunnerOptions) -> torch.Tensor:
    """float32 logits [B, T, vocab] of the export's `backend` on `ids` [B, T] (RunnerError: one line)."""
    cache = folder.options().cache
    check_request(folder.config(), batch=ids.shape[0], prompt_len=ids.shape[1], new_tokens=1,
                  dims=folder.manifest["dynamic_dims"], backend=backend, cache=cache)
    try:
        runner = make_runner(backend, folder.path, options)
        return prefill_logits(runner, folder.config(), ids, dtype=folder.dtype(), cache=cache)
    except (RunnerError, ValueError):
        raise
    except Exception as e:  # noqa: BLE001 - a runtime's own errors can be pages long: one line
        lines = str(e).strip().splitlines()
        raise RunnerError(f"backend {backend}: {type(e).__name__}: {lines[0][:300] if lines else ''}") from None


def save_npy(path: Path, array: np.ndarray, inputs=()) -> None:
    """`array` as a .npy file at `logits --out PATH`, under fileio.write_output's rule (`inputs`: the command's
    (flag, path) inputs); OutputError (one line) otherwise."""
    buf = io.BytesIO()
    np.save(buf, array)
    write_output(path, buf.getvalue(), flag="--out", inputs=inputs)
