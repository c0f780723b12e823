"""Candidates per op, picked by measurement: the run-time choice inside an op's CUDA implementation.

An op's CUDA path may hold several implementations of the same contract (its own Triton kernels, their launch
entries, the field's kernels where installed: fla's KDA, `torch._grouped_mm`). A `Dispatcher` picks one per
(op, shape class) from a table measured on the device (`bench/gpu_check.py --only tune` writes it) and committed
per GPU kind: `<tables>/<kind>.json`, kind from `torch.cuda.get_device_name()` (`gpu_kind`: H100, H200, B200...).

Notable choices:
- The graph never changes: one custom-op node per op, whatever runs inside it; the pick is made at run time,
  inside the op's CUDA implementation (the `.pt2` and AOTInductor call back into it; TensorRT's AOT cubins
  do not, see docs/architecture.md).
- No table for this GPU kind (or no entry for the op's shape class): the op's `default` order, the project's own
  kernels first, so what runs never depends on what happens to be installed.
- A table lists, per shape class, the candidates that passed parity against the reference, fastest first
  (`order`). Only those may be picked. A listed candidate that cannot run here (its package is absent) is
  skipped, and the skip is logged as a warning and recorded in `picks()`; if none can run, `DispatchError`.
- Every first pick per (op, class) is logged (`k3x.dispatch`, INFO) with its reason and kept in `picks()`.
- `forced(op, name)` runs one named candidate (the tune section times and checks each that way); a forced
  candidate that cannot run raises instead of falling back.
Nothing here imports torch at module level or names an op family: families declare their candidates.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

log = logging.getLogger("k3x.dispatch")

FORMAT = 1  # the table's format version; a table of another version is refused with its path named


class DispatchError(RuntimeError):
    """No candidate of an op can run, a table is malformed, or a forced candidate is unknown or absent."""


@dataclass(frozen=True)
class Candidate:
    """One implementation of an op's contract. `requires`: the top-level package it imports (None: always
    present); looked up without importing it. `interprets`: whether it runs under the Triton interpreter (where
    CPU parity tests and gpu_check's self-test run every candidate that does)."""
    name: str
    run: Callable[..., Any]
    requires: str | None = None
    interprets: bool = True

    def missing(self) -> str | None:
        """Why it cannot run in this environment (None if it can)."""
        if self.requires is None:
            return None
        try:
            found = importlib.util.find_spec(self.requires) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else f"{self.requires} is not installed"


KNOWN_KINDS = ("GB300", "GB200", "B300", "B200", "H200", "H100", "H800", "H20", "A100", "L40S", "L4")


def gpu_kind(device_name: str) -> str:
    """The table name of a GPU: a known kind named in `torch.cuda.get_device_name()` ('NVIDIA H100 80GB HBM3' ->
    'H100'), else the name reduced to letters, digits and '-'."""
    for kind in KNOWN_KINDS:
        if re.search(rf"\b{kind}\b", device_name):
            return kind
    return re.sub(r"[^A-Za-z0-9]+", "-", device_name.replace("NVIDIA", "")).strip("-") or "unknown"


def bucket(value: int, edges: Sequence[int], name: str) -> str:
    """The shape class of `value`: 'name<=e' for the first edge e >= value, 'name>last' past the last."""
    for e in edges:
        if value <= e:
            return f"{name}<={e}"
    return f"{name}>{edges[-1]}"


def read_table(path: Path) -> dict:
    """A table file: {"format": 1, "kind", "device", "versions": {...}, "ops": {op: {class: {"order": [...],
    "ms": {name: ms}}}}}. Malformed -> DispatchError naming the file and the field."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DispatchError(f"{path}: not a readable JSON table ({exc})") from None
    if not isinstance(table, dict) or table.get("format") != FORMAT:
        got = table.get("format") if isinstance(table, dict) else table
        raise DispatchError(f"{path}: format must be {FORMAT}, got {got!r}")
    ops = table.get("ops")
    if not isinstance(ops, dict):
        raise DispatchError(f"{path}: 'ops' must be an object")
    for op, classes in ops.items():
        for cls, entry in (classes.items() if isinstance(classes, dict) else [(None, None)]):
            order = entry.get("order") if isinstance(entry, dict) else None
            if not (isinstance(order, list) and order and all(isinstance(n, str) for n in order)):
                raise DispatchError(f"{path}: ops.{op}.{cls}.order must be a non-empty list of candidate names")
    return table


@dataclass(frozen=True)
class Pick:
    op: str
    shape_class: str
    name: str
    reason: str  # "table H200", "default order (no table for CPU)", "forced"
    skipped: tuple[str, ...] = ()  # "name: why" of candidates passed over because they cannot run here


class Dispatcher:
    """Picks among an op's candidates per shape class; one per process (custom_ops/dispatch.py holds it)."""

    def __init__(self, tables: Path, kind: Callable[[], str]):
        self.tables, self.kind = Path(tables), kind
        self._table: dict | None = None
        self._kind: str | None = None
        self._picks: dict[tuple[str, str], Pick] = {}
        self._forced: dict[str, str] = {}

    def table(self) -> tuple[str, dict | None]:
        """(GPU kind, its table or None), read once."""
        if self._kind is None:
            self._kind = self.kind()
            path = self.tables / f"{self._kind}.json"
            self._table = read_table(path) if path.is_file() else None
        return self._kind, self._table

    def reset(self) -> None:
        """Forget the table read and the picks made (a new table on disk, a test's fake device)."""
        self._table, self._kind, self._picks = None, None, {}

    def picks(self) -> list[Pick]:
        return list(self._picks.values())

    @contextmanager
    def forced(self, op: str, name: str) -> Iterator[None]:
        """Run candidate `name` for `op` inside the block (timing and parity of one candidate)."""
        before = self._forced.get(op)
        self._forced[op] = name
        try:
            yield
        finally:
            if before is None:
                self._forced.pop(op, None)
            else:
                self._forced[op] = before

    def pick(self, op: str, shape_class: str, candidates: Sequence[Candidate], default: Sequence[str]) -> Candidate:
        by_name = {c.name: c for c in candidates}
        if op in self._forced:
            c = by_name.get(self._forced[op])
            if c is None or c.missing():
                why = "unknown" if c is None else c.missing()
                raise DispatchError(f"{op}: forced candidate {self._forced[op]!r} cannot run ({why})")
            return c
        done = self._picks.get((op, shape_class))
        if done is not None:
            return by_name[done.name]
        kind, table = self.table()
        entry = ((table or {}).get("ops", {}).get(op) or {}).get(shape_class)
        if entry:
            order, reason = entry["order"], f"table {kind}"
        else:
            order, reason = list(default), f"default order (no table entry for {kind})"
        skipped = []
        for name in order:
            c = by_name.get(name)
            why = "not a candidate of this build" if c is None else c.missing()
            if why is None:
                p = Pick(op, shape_class, name, reason, tuple(skipped))
                self._picks[(op, shape_class)] = p
                log.info("dispatch %s [%s]: %s (%s)", op, shape_class, name, reason)
                for s in skipped:
                    log.warning("dispatch %s [%s]: skipped %s", op, shape_class, s)
                return c
            skipped.append(f"{name}: {why}")
        raise DispatchError(f"{op} [{shape_class}]: no candidate can run ({reason}; {'; '.join(skipped)})")
