"""The checkpoint's tokenizer files copied into an export as artifact `tokenizer` (both writers: one program
and rank programs). Torch-free at import: checkpoint and folder modules are imported when it runs."""

from __future__ import annotations

from pathlib import Path


def copy_tokenizer(checkpoint: Path, out_dir: Path) -> str:
    """Copy the checkpoint's tokenizer / generation files (text/tokenizer.TOKENIZER_FILES) into the export
    as artifact `tokenizer`, so `k3x run --prompt` and ONNX Runtime GenAI find them beside the models.
    Each must resolve inside the checkpoint folder (a symlink to a file elsewhere is refused, CheckpointError);
    copies never get wider permissions than their source (fileio.copy_file)."""
    import os

    from ..checkpoint.files import checkpoint_file
    from ..fileio import copy_file
    from ..folder import artifacts
    from ..text.tokenizer import TOKENIZER_FILES

    checkpoint = Path(checkpoint)
    found = [checkpoint_file(checkpoint, n) for n in TOKENIZER_FILES if os.path.lexists(checkpoint / n)]
    found = [f for f in found if f.is_file()]
    if not found:
        return f"tokenizer: none in {checkpoint} (text prompts need tokenizer.json or tiktoken.model)"
    with artifacts.write_artifact(out_dir, "tokenizer") as tmp:
        for f in found:
            copy_file(f, tmp / f.name)
    return "tokenizer: " + ", ".join(f.name for f in found)
