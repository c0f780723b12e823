"""The server tests' exports and servers: k3-mini with a tokenizer and chat template (`chat_export`), served
in this process by uvicorn on a thread, on an ephemeral port of 127.0.0.1 (`server`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from http_cases import start
from xdist_support import build_once


@pytest.fixture(scope="session")
def chat_export(request) -> Path:
    """`init-checkpoint --preset k3-mini` (seed 0, dense experts, the tiny BPE tokenizer and its chat template)
    exported with --serving, block size 8, ONNX."""
    from k3x.checkpoint.random_init import init_checkpoint
    from k3x.exporter.options import ExportOptions, Target
    from k3x.exporter.pipeline import export

    def build(root: Path) -> None:
        init_checkpoint("k3-mini", root / "ckpt", expert_format="dense")
        export(ExportOptions((Target.ONNX,), root / "k3-mini", checkpoint=root / "ckpt", serving=True, block_size=8))

    return build_once(request, "chat-serving", build) / "k3-mini"


@pytest.fixture(scope="module")
def server(chat_export):
    running = start(chat_export)
    yield running
    running.stop()
