"""A faster `torch.export.save` for programs whose nodes repeat (a stamped trace, exporter/stamp.py): the same
`.pt2`, byte for byte, with each distinct node serialised once.

Where `torch.export.save` (torch 2.13) spends its time on the stamped K3 program (15,553 nodes; cProfile,
36 s of which):
- 59 %: `canonicalize`, run by torch's ExportedProgramSerializer only to check that a canonical form exists:
  a `copy.deepcopy` of the whole serialised program (17 s alone), sorted and renamed, then thrown away;
- 21 %: torch's GraphModuleSerializer, node by node (schema walk, sympy printing of every symbolic size),
  including a debug-log rendering of the whole graph as Python that is built whether logged or not (4 %);
- 17 %: the serialised dataclasses turned into dicts and then JSON.

`save_fast` writes the archive `torch.export.save` writes, with torch's own pieces (GraphModuleSerializer and
its signature / module-call-graph / range-constraint serialisers, the archive writer and its state-dict and
constants packers), but:
1. without the discarded canonical copy;
2. torch serialises only the first node of each *shape* (`_Shapes.key`: the op, its arguments with every
   node replaced by its position and the kind torch serialises it as, the output structure and getitem users).
   A later node of that shape (a stamped block's node in each of its 69 or 24 layers) is the first one's JSON
   text with the names put in (`_Template`); its metadata (stack trace, module stack) is serialised by torch's
   own method for that node, and the tensor metadata of its outputs once per value object (the stamped trace
   shares them between layers);
3. the graph's JSON is joined from the nodes' text, not built as one tree of dataclasses.
Every `check_every`-th copied node is also serialised by torch and compared (0: none); a difference is a
StampSaveError, and `save_recorded` (the export pipeline's pt2 save) then falls back to `torch.export.save`
and records why. tests/exporter/test_stamp.py pins the archive to torch's, record by record.
"""

from __future__ import annotations

import json
import operator
import re
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch
from torch.export import ExportedProgram
from torch.fx import Node

_getitem = operator.getitem
CHECK_EVERY = 64  # a copied node in this many is serialised by torch too and compared
_SLOT = re.compile(r'"@@k3x:(\d+|meta)@@"')


class StampSaveError(RuntimeError):
    """A copied node's serialisation is not what torch gives it (save_recorded falls back to torch)."""


class _NoShape(Exception):
    """The node is serialised by torch itself (not memoised)."""


def _quote(s: str) -> str:
    return json.encoder.encode_basestring_ascii(s)


class _Template:
    """One serialised node as JSON text with a slot for each name and for the metadata."""

    def __init__(self, node_dict: dict, names: list[str], encode: Callable[[Any], str]) -> None:
        index: dict[str, int] = {}
        for i, n in enumerate(names):
            if index.setdefault(n, i) != i:
                raise _NoShape  # one node in two roles
        if node_dict.get("name") != names[0]:
            raise _NoShape
        slots = {**{k: self._sub(v, index) for k, v in node_dict.items()},
                 "metadata": "@@k3x:meta@@", "name": "@@k3x:0@@"}
        text = encode(slots)
        parts = _SLOT.split(text)
        if text.count("@@k3x:") != len(parts) // 2:
            raise _NoShape  # a sentinel-like string of the node's own
        self.literals = parts[0::2]
        self.slots = [-1 if s == "meta" else int(s) for s in parts[1::2]]

    @classmethod
    def _sub(cls, o: Any, index: dict[str, int]) -> Any:
        """`o` with every value name (TensorArgument `{"name": n}`, SymInt/Float/Bool `{"as_name": n}`) a slot."""
        if isinstance(o, dict):
            if len(o) == 1:
                ((k, v),) = o.items()
                if str(k) in ("name", "as_name") and isinstance(v, str):  # str(): torch's union tags
                    if v not in index:
                        raise _NoShape
                    return {k: f"@@k3x:{index[v]}@@"}
            return {k: cls._sub(v, index) for k, v in o.items()}
        if isinstance(o, list):
            return [cls._sub(x, index) for x in o]
        return o

    def render(self, names: list[str], metadata: str) -> str:
        out = [self.literals[0]]
        for slot, lit in zip(self.slots, self.literals[1:]):
            out.append(metadata if slot < 0 else _quote(names[slot]))
            out.append(lit)
        return "".join(out)


_CONSTANTS = (int, float, bool, str, complex, type(None), torch.dtype, torch.device, torch.memory_format,
              torch.layout)


class _Shapes:
    """What torch's serialisation of a call_function node depends on, names aside (`key`), and the names."""

    def __init__(self, ser: Any, sym_ops: Any) -> None:
        self.ser, self.sym_ops = ser, sym_ops

    def _kind(self, a: Node) -> str:
        """How torch's `serialize_input` writes a node argument."""
        gs, name = self.ser.graph_state, a.name
        if a.op == "get_attr" or name in self.ser.duplicate_getitem_nodes:
            raise _NoShape
        if name in gs.sym_int_values:
            return "i"
        if name in gs.sym_float_values:
            return "f"
        if name in gs.sym_bool_values:
            return "b"
        if not isinstance(a.meta.get("val"), torch.Tensor):
            raise _NoShape
        return "t"

    def _arg(self, a: Any, names: list[str], seen: dict[Node, int]) -> Any:
        t = type(a)
        if t is Node:
            i = seen.get(a)
            if i is None:
                i = seen[a] = len(names)
                names.append(a.name)
                return i, self._kind(a)
            return i
        if isinstance(a, (list, tuple)):  # fx's immutable_list is a list
            return isinstance(a, tuple), tuple(self._arg(x, names, seen) for x in a)
        if isinstance(a, dict):
            return dict, tuple((k, self._arg(v, names, seen)) for k, v in a.items())
        if t is float:
            return t, repr(a)  # -0.0 == 0.0, nan != nan
        if isinstance(a, _CONSTANTS):
            return t, a
        raise _NoShape

    @staticmethod
    def outputs(node: Node) -> tuple[tuple, list[str], list[Any]]:
        """(output structure, names, values) of the tensors torch records for `node` (tensor_values)."""
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return ("T",), [node.name], [val]
        if val is None:
            return ("N",), [], []
        if type(val) not in (list, tuple) or not all(v is None or isinstance(v, torch.Tensor) for v in val):
            raise _NoShape
        users: dict[int, str] = {}
        for u in node.users:
            if u.target is not _getitem or u.args[1] in users:
                raise _NoShape
            users[u.args[1]] = u.name
        names = [users.get(i, f"{node.name}_unused_{i}") for i, v in enumerate(val) if v is not None]
        struct = (type(val), tuple(v is None for v in val), tuple(sorted(users)))
        return struct, names, [v for v in val if v is not None]

    def key(self, node: Node) -> tuple[tuple, list[str], list[str], list[Any]]:
        """(shape key, every name in slot order, output names, output values); _NoShape where torch must
        serialise the node itself."""
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or target in self.sym_ops or \
                isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise _NoShape
        names, seen = [node.name], {}
        args = self._arg(node.args, names, seen), self._arg(node.kwargs, names, seen)
        struct, out_names, vals = self.outputs(node)
        slots = names + [n for n in out_names if n != node.name]  # a single output is named as its node
        return (target, args, struct), slots, out_names, vals


_NEW = object()


class _GraphText:
    """The graph's nodes and tensor values as JSON text, in torch's order: torch's GraphModuleSerializer for
    placeholders, size computations, the output and the first node of each shape; copies for the rest."""

    def __init__(self, ep: ExportedProgram, check_every: int) -> None:
        from torch._export.serde import serialize as serde

        self.serde, self.check_every = serde, check_every
        self.ser = serde.GraphModuleSerializer(ep.graph_signature, ep.module_call_graph)
        self.shapes = _Shapes(self.ser, serde._SYM_OPS)
        self.encode = serde.EnumEncoder(allow_nan=False).encode  # as torch's _to_json_bytes
        self.nodes: list[str] = []
        self.values: dict[str, str] = {}
        self.metas: dict[int, str] = {}  # id(tensor value) -> its TensorMeta as JSON
        self.templates: dict[tuple, _Template | None] = {}
        self.copied = 0

    def _json(self, obj: Any) -> str:
        return self.encode(self.serde._dataclass_to_dict(obj))

    def _torch(self, node: Node) -> None:
        getattr(self.ser, f"handle_{node.op}")(node)

    def _drain(self) -> None:
        """Move what torch just serialised into the text lists."""
        gs = self.ser.graph_state
        self.nodes.extend(self._json(n) for n in gs.nodes)
        for name, meta in gs.tensor_values.items():
            self._value(name, self._json(meta))
        gs.nodes.clear()
        gs.tensor_values.clear()

    def _value(self, name: str, text: str) -> None:
        if name in self.values:
            raise StampSaveError(f"value {name} is serialised twice")
        self.values[name] = text

    def _meta(self, v: torch.Tensor) -> str:
        text = self.metas.get(id(v))
        if text is None:
            text = self.metas[id(v)] = self._json(self.serde.serialize_tensor_meta(v))
        return text

    def add(self, node: Node) -> None:
        try:
            key, names, out_names, vals = self.shapes.key(node) if node.op == "call_function" else (None,) * 4
        except _NoShape:
            key = None
        template = None if key is None else self.templates.get(key, _NEW)
        if template is _NEW:
            self._first(node, key, names, out_names)
        elif template is None:
            self._torch(node)
            self._drain()
        else:
            self._copy(node, template, names, out_names, vals)

    def _first(self, node: Node, key: tuple, names: list[str], out_names: list[str]) -> None:
        self._torch(node)
        gs = self.ser.graph_state
        try:
            if len(gs.nodes) != 1 or list(gs.tensor_values) != out_names:
                raise _NoShape
            self.templates[key] = _Template(self.serde._dataclass_to_dict(gs.nodes[0]), names, self.encode)
        except _NoShape:
            self.templates[key] = None
        self._drain()

    def _copy(self, node: Node, template: _Template, names: list[str], out_names: list[str], vals: list) -> None:
        text = template.render(names, self.encode(self.ser.serialize_metadata(node)))
        metas = [self._meta(v) for v in vals]
        self.copied += 1
        if self.check_every and self.copied % self.check_every == 0:
            self._torch(node)
            gs = self.ser.graph_state
            want = [self._json(n) for n in gs.nodes], [(k, self._json(v)) for k, v in gs.tensor_values.items()]
            gs.nodes.clear()
            gs.tensor_values.clear()
            if want != ([text], list(zip(out_names, metas))):
                raise StampSaveError(f"node {node.name}: its copied serialisation is not torch's")
        self.nodes.append(text)
        for name, meta in zip(out_names, metas):
            self._value(name, meta)


def program_json(ep: ExportedProgram, *, check_every: int = CHECK_EVERY) -> tuple[bytes, dict[str, int]]:
    """`models/model.json` of `ep` as torch.export.save writes it, and {"nodes", "serialised", "copied"}."""
    from torch._export.serde import serialize as serde

    ep.validate()  # as torch's ExportedProgramSerializer does first
    g = _GraphText(ep, check_every)
    for node in ep.graph.nodes:
        g.add(node)
    gs, ser = g.ser.graph_state, g.ser
    graph = serde.Graph(inputs=gs.inputs, nodes=[], tensor_values={}, sym_int_values=gs.sym_int_values,
                        sym_float_values=gs.sym_float_values, sym_bool_values=gs.sym_bool_values,
                        custom_obj_values=gs.custom_obj_values, outputs=gs.outputs,
                        is_single_tensor_return=gs.is_single_tensor_return)
    module = serde.GraphModule(graph=graph, signature=ser.serialize_signature(ep.graph_signature),
                               module_call_graph=ser.serialize_module_call_graph(ep.module_call_graph),
                               metadata=ser.serialize_graph_module_metadata(ep.graph_module.meta),
                               treespec_namedtuple_fields=ser.treespec_namedtuple_fields)
    program = serde.ExportedProgram(
        graph_module=module, opset_version={"aten": torch._C._get_max_operator_version()},
        range_constraints=serde.serialize_range_constraints(ep.range_constraints),
        schema_version=serde.SchemaVersion(major=serde.SCHEMA_VERSION[0], minor=serde.SCHEMA_VERSION[1]),
        verifiers=[v.dialect for v in ep.verifiers], torch_version=torch.__version__, guards_code=ep._guards_code)
    tree = serde._dataclass_to_dict(program)
    tree["graph_module"]["graph"].update(nodes="@@k3x:nodes@@", tensor_values="@@k3x:values@@")
    head, sep1, rest = g.encode(tree).partition('"@@k3x:nodes@@"')
    middle, sep2, tail = rest.partition('"@@k3x:values@@"')
    if not (sep1 and sep2) or "@@k3x:" in head + middle + tail:
        raise StampSaveError("the program's own strings hold the save's sentinels")
    values = ", ".join(f"{_quote(k)}: {v}" for k, v in g.values.items())
    text = "".join((head, "[", ", ".join(g.nodes), "]", middle, "{", values, "}", tail))
    serialised = len(g.nodes) - g.copied
    return text.encode("utf-8"), {"nodes": len(ep.graph.nodes), "serialised": serialised, "copied": g.copied}


def save_fast(ep: ExportedProgram, f: str | Path | BinaryIO, *, check_every: int = CHECK_EVERY) -> dict[str, int]:
    """Write `ep` to `f` as `torch.export.save(ep, f)` does (the same records, the same bytes but the
    archive's random serialization id), the graph by `program_json`; returns its counts. Nothing is
    written when the graph cannot be serialised."""
    from torch._export.non_strict_utils import _enable_graph_inputs_of_type_nn_module
    from torch._export.serde.serialize import serialize_torch_artifact
    from torch.export.pt2_archive import _package as pkg
    from torch.export.pt2_archive import constants as names

    model, counts = program_json(ep, check_every=check_every)
    protocol = pkg.DEFAULT_PICKLE_PROTOCOL
    with _enable_graph_inputs_of_type_nn_module(ep.example_inputs):
        examples = serialize_torch_artifact(ep.example_inputs, protocol)
    with pkg.PT2ArchiveWriter(str(f) if isinstance(f, Path) else f) as w:
        weights = pkg._package_state_dict("model", ep, w, protocol)
        pkg._package_payload_config(w, weights, names.WEIGHTS_CONFIG_FILENAME_FORMAT.format("model"))
        constants = pkg._package_constants("model", ep, w, protocol)
        pkg._package_payload_config(w, constants, names.CONSTANTS_CONFIG_FILENAME_FORMAT.format("model"))
        w.write_bytes(names.MODELS_FILENAME_FORMAT.format("model"), model)
        w.write_bytes(names.SAMPLE_INPUTS_FILENAME_FORMAT.format("model"), examples)
    return counts


def _fast_or_raise(ep: ExportedProgram, f: Any) -> None:
    """save_fast, any failure of its own (a failed check, torch internals that moved) a StampSaveError."""
    try:
        save_fast(ep, f)
    except (OSError, StampSaveError):
        raise
    except Exception as e:
        raise StampSaveError(f"{type(e).__name__}: {e}") from e


def save_recorded(write: Callable[[Callable[..., Any]], Any], *, stamped: bool) -> tuple[Any, dict[str, Any]]:
    """`write(save)`, where `save(ep, f)` writes a program's `.pt2`: `save_fast` when the program is stamped
    (exporter/stamp.py), else (or when the fast save fails: `write` is called again) `torch.export.save`.
    Returns what `write` returned and the manifest's `save` entry: {"mode": "fast" | "torch", "fallback": why a
    stamped program was saved by torch after all, or null}."""
    reason = None
    if stamped:
        try:
            return write(_fast_or_raise), {"mode": "fast", "fallback": None}
        except StampSaveError as e:
            reason = str(e).splitlines()[0]
    return write(torch.export.save), {"mode": "torch", "fallback": reason}
