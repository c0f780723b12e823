"""Render a chat template with bounded time, memory and output: a checkpoint's template is code from anyone.

    text = render_chat_template(template, variables, where="ckpt/chat_template.jinja")

Notable choices:
- Jinja's `ImmutableSandboxedEnvironment` (as transformers) stops attribute tricks but not cost: nested
  loops run for hours and `'a' * 10**10` or `'x'|center(10**10)` allocate in one C call that no Python
  check can interrupt (the process aborted, exit 134). So the template renders in a child interpreter
  (`python -I` running this file: no PYTHONPATH, no current folder on sys.path) under OS limits — address
  space `MAX_MEMORY`, wall time `DEADLINE_S` — with the source capped at `MAX_SOURCE` characters, `range()`
  at `MAX_RANGE` items, the loop iterations and calls of one render at `MAX_STEPS`, and the output at
  `MAX_OUTPUT` characters (counted while it is produced). Each bound is one `ChatTemplateError` line.
- The child reports `{"text": ...}` or `{"error": ...}` as JSON on stdout; anything else (a signal, no
  answer) is an error too. Startup costs about 0.1 s, once per `--chat` prompt.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

MAX_SOURCE = 1 << 20  # characters of template source
MAX_OUTPUT = 1 << 20  # characters of rendered text
MAX_RANGE = 10_000  # items of one range()
MAX_STEPS = 250_000  # loop iterations + calls in one render
MAX_MEMORY = 1 << 30  # bytes of address space above the child's start
DEADLINE_S = 10.0


class ChatTemplateError(ValueError):
    """The chat template cannot be rendered within the bounds (or fails); the message names the file."""


def render_chat_template(template: str, variables: dict[str, Any], where: str) -> str:
    """`template` rendered with `variables` (JSON-able) in a bounded child process (module docstring)."""
    if len(template) > MAX_SOURCE:
        raise ChatTemplateError(f"{where}: {len(template):,} characters; a chat template is at most {MAX_SOURCE:,}")
    request = json.dumps({"template": template, "variables": variables})
    try:
        done = subprocess.run([sys.executable, "-I", __file__], input=request.encode(), capture_output=True,
                              timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        raise ChatTemplateError(f"{where}: the chat template did not finish within {DEADLINE_S:.0f} s") from None
    except OSError as e:
        raise ChatTemplateError(f"{where}: cannot start the template renderer ({e.strerror})") from None
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        answer = {"error": f"the renderer ended without an answer (exit {done.returncode})"}
    if not isinstance(answer, dict) or not isinstance(answer.get("text"), str):
        raise ChatTemplateError(f"{where}: the chat template fails: {str(answer.get('error'))[:300]}")
    return answer["text"]


def _child() -> None:
    """The renderer process: read the request on stdin, limit itself, render, answer on stdout."""
    import resource

    def answer(**kw: str) -> None:
        sys.stdout.write(json.dumps(kw))
        sys.stdout.flush()

    with open("/proc/self/statm") as f:
        start = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (start + MAX_MEMORY, start + MAX_MEMORY))
    request = json.loads(sys.stdin.read())
    try:
        answer(text=_render(request["template"], request["variables"]))
    except MemoryError:
        answer(error=f"needs more than {MAX_MEMORY >> 20} MiB of memory")
    except RecursionError:
        answer(error="recursion too deep")
    except Exception as e:  # noqa: BLE001 - a template can raise anything; one line
        lines = str(e).strip().splitlines()
        answer(error=f"{type(e).__name__}: {lines[0][:300] if lines else ''}")


def _render(template: str, variables: dict[str, Any]) -> str:
    from jinja2 import TemplateError, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        steps = 0

        def step(self, n: int = 1) -> None:
            Bounded.steps += n
            if Bounded.steps > MAX_STEPS:
                raise TemplateError(f"more than {MAX_STEPS:,} loop iterations and calls")

        def call(self, __context, __obj, *args, **kwargs):  # every call a sandboxed template makes
            self.step()
            return super().call(__context, __obj, *args, **kwargs)

        def counted(self, iterable):
            for item in iterable:
                self.step()
                yield item

        def _parse(self, source, name, filename):  # every for loop iterates through `counted`
            tree = super()._parse(source, name, filename)
            for loop in tree.find_all(nodes.For):
                loop.iter = nodes.Call(nodes.EnvironmentAttribute("counted"), [loop.iter], [], None, None)
            return tree

    def bounded_range(*args: int) -> range:
        r = range(*args)
        if len(r) > MAX_RANGE:
            raise TemplateError(f"range() of {len(r):,} items; at most {MAX_RANGE:,}")
        return r

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = Bounded(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(range=bounded_range, raise_exception=raise_exception)
    parts, size = [], 0
    for part in env.from_string(template).generate(**variables):
        size += len(part)
        if size > MAX_OUTPUT:
            raise TemplateError(f"renders more than {MAX_OUTPUT:,} characters")
        parts.append(part)
    return "".join(parts)


if __name__ == "__main__":
    _child()
