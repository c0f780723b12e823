"""The checkpoint's tokenizer files: checked when an export's job is resolved (`tokenizer_files`, before anything
is built or traced, so a bad one is refused at once) and again where they are copied into the export as artifact
`tokenizer` (`copy_tokenizer`; both writers: one program and rank programs), so what is copied is what was
just checked. Torch-free at import: checkpoint and folder modules are imported when it runs."""

from __future__ import annotations

from pathlib import Path


def tokenizer_files(checkpoint: Path) -> tuple[Path, ...]:
    """The checkpoint's tokenizer / generation files (text/tokenizer.TOKENIZER_FILES), each resolved inside the
    checkpoint folder or, in a hub snapshot, its repository's blobs/ (a symlink to a file elsewhere is refused,
    CheckpointError; fileio.confined). They are copied under these names, as files."""
    import os

    from ..checkpoint.files import checkpoint_file
    from ..text.tokenizer import TOKENIZER_FILES

    checkpoint = Path(checkpoint)
    found = [checkpoint_file(checkpoint, n) for n in TOKENIZER_FILES if os.path.lexists(checkpoint / n)]
    return tuple(f for f in found if f.is_file())


def copy_tokenizer(checkpoint: Path, out_dir: Path) -> str:
    """Copy the checkpoint's `tokenizer_files` into the export as artifact `tokenizer`, so `k3x run --prompt` and
    ONNX Runtime GenAI find them beside the models; copies never get wider permissions than their source
    (fileio.copy_file)."""
    from ..fileio import copy_file
    from ..folder import artifacts

    files = tokenizer_files(checkpoint)
    if not files:
        return f"tokenizer: none in {checkpoint} (text prompts need tokenizer.json or tiktoken.model)"
    with artifacts.write_artifact(out_dir, "tokenizer") as tmp:
        for f in files:
            copy_file(f, tmp / f.name)
    return "tokenizer: " + ", ".join(f.name for f in files)
