"""`k3x`: one short command per pipeline stage; heavy imports happen inside the commands."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(
    name="k3x",
    help="Kimi-K3 compiled graph export: checkpoint -> torch.export / ONNX / TensorRT / AOTInductor, parity proven.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s")


def fail(message: str) -> None:
    """Print an error that names the bad input and exit 1."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=1)
