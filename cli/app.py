"""The `k3x` Typer app: the one mapping of the library's typed input errors to one-line exits, the global
flags (`-v` anywhere on the line, `--version`), and nothing else; the commands live in one module per
group (checkpoint.py, export.py, run.py, verify.py) and register themselves on `app`.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Callable

import typer

from .console import fail
from .options import Verbose, Version


class App(typer.Typer):
    """`k3x CMD ... -v` works like `k3x -v CMD ...`: the global flag is moved before the command; every
    command's typed input errors are one line (`one_line_errors`)."""

    def __call__(self, *args, **kwargs):
        if not args and "args" not in kwargs:
            kwargs["args"] = hoist_global_flags(sys.argv[1:])
        return super().__call__(*args, **kwargs)

    def command(self, *args, **kwargs):
        register = super().command(*args, **kwargs)
        return lambda f: register(one_line_errors(f))


def input_errors() -> tuple[type[Exception], ...]:
    """The library's typed errors for bad input: each message names the file or field."""
    from ..checkpoint.files import CheckpointError
    from ..export.engine import EngineBuildError
    from ..folder.artifacts import ManifestError
    from ..folder.staging import FolderError
    from ..model.config import ConfigError
    from ..runtime.runners import RunnerError
    from ..text.prompt import PromptError
    from ..text.tokenizer import TokenizerError

    return (ConfigError, TokenizerError, PromptError, CheckpointError, ManifestError, FolderError, EngineBuildError,
            RunnerError)


def one_line_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command` with the library's typed input errors (`input_errors`) turned into one `fail` line, wherever
    in the command they are raised (the one mapping; no per-command try/except needed for them)."""
    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except input_errors() as e:  # evaluated only when an exception propagates
            fail(str(e))

    return wrapper


def hoist_global_flags(argv: list[str]) -> list[str]:
    flags = [a for a in argv if a in ("-v", "--verbose")]
    return flags + [a for a in argv if a not in ("-v", "--verbose")]


app = App(
    name="k3x",
    help="Kimi-K3 compiled graph export: checkpoint -> torch.export / ONNX / TensorRT / AOTInductor, parity proven.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,  # plain help: no `<bool>` placeholder after flags (it invited `--chat true`)
)


@app.callback()
def main(verbose: Verbose = False, version: Version = False) -> None:
    """Global flags; `-v` may also follow the command."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("k3x").setLevel(logging.DEBUG if verbose else logging.INFO)
