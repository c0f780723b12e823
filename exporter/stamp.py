"""The stamped trace: each distinct decoder layer is traced once and its graph copied for every layer.

K3's 93 layers have few distinct shapes: the mixer (KDA / MLA), the FFN (dense / MoE), whether the layer
starts an AttnRes block and whether it has a bank yet. `trace_stamped`:

1. traces one representative layer per distinct `layer_key` with `torch.export` (the bank's source count is a
   dynamic dim there, so one trace serves every block of the model);
2. traces the model with every layer replaced by one opaque `k3x_stamp::layer` node (the skeleton: embedding,
   state plumbing, output mix, head), whose fake impl gives each layer's output shapes from its template;
3. splices each template's nodes in place of its layer's node, with the template's parameters bound to that
   layer's placeholders (`model.layers.{i}.` + the template's name) and its symbols to the skeleton's sizes
   (exporter/stamp_meta.py); node names are then given in graph order as torch.export names them.

The result has the per-layer trace's signature (placeholders, parameter names, inputs, outputs), state_dict,
range constraints and call specs, and the same nodes; tests/exporter/test_stamp.py compares both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry
from torch.fx.passes.runtime_assert import insert_deferred_runtime_asserts
from torch.export.graph_signature import ExportGraphSignature, InputKind, OutputSpec, TensorArgument

from ..model import K3ForCausalLM
from ..model.options import CacheOptions
from ..model.state import state_specs
from .stamp_meta import StampError, SymbolMap, free_symbols, tensor_meta
from .options import TraceMode
from .trace import dynamic_shapes, example_inputs, torch_dims, trace

TRACE_MODES = tuple(m.value for m in TraceMode)  # each distinct layer traced once (here) | every layer (trace.trace)

_getitem = operator.getitem
_TEMPLATES: dict[int, Template] = {}  # layer index -> its template, while a skeleton is traced


@torch.library.custom_op("k3x_stamp::layer", mutates_args=())
def _layer_op(index: int, prefix: Tensor, bank: Tensor | None, state: list[Tensor],
              length: Tensor | None) -> list[Tensor]:
    raise RuntimeError("k3x_stamp::layer only stands in for a decoder layer while a stamped trace runs")


@_layer_op.register_fake
def _(index, prefix, bank, state, length):
    t = _TEMPLATES[index]
    env = SymbolMap.bind(None, t.input_vals, [prefix, bank, *state, length])
    return [torch.empty_strided([env.size(s) for s in v.shape], [env.size(s) for s in v.stride()],
                                dtype=v.dtype, device=v.device) for v in t.output_vals]


def layer_key(model: K3ForCausalLM, i: int) -> str:
    return model.cfg.layer_kind(i)


class _LayerCall(nn.Module):
    """One decoder layer as a program: (prefix, bank, state, length) -> [prefix, bank?, *state]."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, prefix: Tensor, bank: Tensor | None, state: list[Tensor], length: Tensor | None):
        p, b, s = self.layer(prefix, bank, list(state), length)
        return [p, *([] if b is None else [b]), *s]


@dataclass
class Template:
    ep: ExportedProgram
    input_vals: list[Any]  # prefix, bank, *state, length (None where absent)
    output_vals: list[Tensor]
    has_bank_out: bool

    @property
    def placeholders(self) -> dict[str, torch.fx.Node]:
        return {n.name: n for n in self.ep.graph.nodes if n.op == "placeholder"}


def _trace_template(model: K3ForCausalLM, i: int, dtype: torch.dtype, cache: CacheOptions | None) -> Template:
    cfg, d = model.cfg, torch_dims()
    device = next(model.parameters()).device
    ids, past = example_inputs(cfg, dtype=dtype, device=device, cache=cache)
    specs = state_specs(cfg, cache)
    state = [t for t, s in zip(past, specs) if s.layer == i]
    length = past[-1] if cache is not None and cache.max_context is not None else None
    prefix = torch.zeros(*ids.shape, cfg.hidden_size, dtype=dtype, device=device)
    bh = {0: d["batch"], 1: d["seq"]}
    bank = None
    if cfg.block_starts() and i > 0:
        bank = torch.zeros(*ids.shape, 2, cfg.hidden_size, dtype=dtype, device=device)
        sources = torch.export.Dim("bank_sources", min=1, max=max(2, len(cfg.block_starts())))
    state_dims = [{0: d["batch"], 1: d["past_seq"]} if s.dims[1:2] == ("past_seq",) else {0: d["batch"]}
                  for s in specs if s.layer == i]
    dyn = (bh, None if bank is None else {**bh, 2: sources}, state_dims, None)
    with torch.no_grad(), torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
        ep = torch.export.export(_LayerCall(model.model.layers[i]), (prefix, bank, state, length),
                                 dynamic_shapes=dyn)
    for spec in ep.graph_signature.input_specs:
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.USER_INPUT):
            raise StampError(f"stamped trace: layer {i} has a {spec.kind.name} input")
    sig = ep.graph_signature
    weights = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    users = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name not in weights]
    if len(users) != 3 + len(state):
        raise StampError(f"stamped trace: layer {i}'s program has {len(users)} inputs, not {3 + len(state)}")
    input_vals = [n.meta.get("val") for n in users]
    out = [n.meta["val"] for n in ep.graph.output_node().args[0]]
    return Template(ep, input_vals, out, bank is not None or (bool(cfg.block_starts()) and i == 0))


class _StandIn(nn.Module):
    """Decoder layer i in the skeleton: one `k3x_stamp::layer` call, no parameters (the template's are
    added as placeholders when it is spliced in: `_Splicer.add_weights`)."""

    def __init__(self, index: int, has_bank_out: bool) -> None:
        super().__init__()
        self.index, self.has_bank_out = index, has_bank_out

    def forward(self, prefix, bank, state, length=None, mix=None):
        outs = torch.ops.k3x_stamp.layer(self.index, prefix, bank, list(state), length)
        k = 2 if self.has_bank_out else 1
        return outs[0], outs[1] if k == 2 else None, list(outs[k:])


@contextlib.contextmanager
def _stand_ins(model: K3ForCausalLM, templates: dict[int, Template]) -> Iterator[None]:
    """The decoder layers replaced by parameter-less `_StandIn`s (restored on exit)."""
    layers = model.model.layers
    _TEMPLATES.update(templates)
    try:
        model.model.layers = nn.ModuleList(_StandIn(i, t.has_bank_out) for i, t in templates.items())
        yield
    finally:
        model.model.layers = layers
        _TEMPLATES.clear()


def _module_stack(op_stack: dict, template_stack: dict | None, i: int) -> dict:
    """The template node's module stack under layer i's entry of the skeleton node's stack."""
    out = dict(op_stack)
    for key, (path, cls) in (template_stack or {}).items():
        if path == "layer":  # the skeleton's entry names the stand-in's class
            out = {k: (p, cls) if p == f"model.layers.{i}" else (p, c) for k, (p, c) in out.items()}
        elif path.startswith("layer."):
            rel = path[len("layer"):]
            out[f"L__self__model.layers.{i}{rel}"] = (f"model.layers.{i}{rel}", cls)
    return out


def _join_traces(outer: str, inner: str) -> str:
    """The stack trace a per-layer trace records: the skeleton node's frames up to the layer call, then the
    template's frames below its wrapper (`_LayerCall.forward`)."""
    frames = re.compile(r"\n(?=  File \")")
    return "\n".join(frames.split(outer)[:-1] + frames.split(inner)[1:])


class _Splicer:
    """Copies template graphs into the skeleton in place of its `k3x_stamp::layer` nodes."""

    def __init__(self, skeleton: ExportedProgram, templates: dict[int, Template]) -> None:
        self.ep, self.templates = skeleton, templates
        sig = skeleton.graph_signature
        by_name = {n.name: n for n in skeleton.graph.nodes if n.op == "placeholder"}
        self.by_fqn = {fqn: by_name[name] for name, fqn in
                       {**sig.inputs_to_parameters, **sig.inputs_to_buffers}.items()}
        self.specs = {s.target: s for s in sig.input_specs if s.target is not None}
        self.fake_mode = torch._guards.detect_fake_mode([n.meta.get("val") for n in by_name.values()])
        self.first = next(iter(by_name.values()))
        self.values: dict[tuple, tuple[Any, Any]] = {}  # memoised (val, tensor_meta) of template nodes
        self.symbols: dict[tuple, frozenset] = {}

    def add_weights(self, i: int, t: Template) -> None:
        """Placeholders (and input specs) for layer i's parameters and buffers, named as torch.export names
        them (`p_model_layers_{i}_...`), with fake values of the skeleton's fake mode."""
        prefix = f"model.layers.{i}."
        for spec in t.ep.graph_signature.input_specs:
            if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
                continue
            fqn = prefix + spec.target.removeprefix("layer.")
            kind, _, rest = spec.arg.name.partition("_layer_")
            node = t.placeholders[spec.arg.name]
            with self.ep.graph.inserting_before(self.first):
                new = self.ep.graph.placeholder(f"{kind}_model_layers_{i}_{rest}")
            new.meta = dict(node.meta)
            new.meta["val"] = SymbolMap(self.fake_mode, {}).value(node.meta["val"])
            if "tensor_meta" in node.meta:
                new.meta["tensor_meta"] = tensor_meta(new.meta["val"], node.meta["tensor_meta"])
            self.by_fqn[fqn] = new
            self.specs[fqn] = dataclasses.replace(spec, arg=TensorArgument(new.name), target=fqn)

    def splice_all(self) -> None:
        ops = [n for n in self.ep.graph.nodes if n.target is torch.ops.k3x_stamp.layer.default]
        for op in ops:
            self.splice(op)

    def _value(self, t: Template, n: torch.fx.Node, env: SymbolMap) -> tuple[Any, Any]:
        v = n.meta.get("val")
        syms = self.symbols.setdefault((id(t), n.name), free_symbols(v))
        key = (id(t), n.name, env.key(syms))
        if key not in self.values:
            new = env.value(v)
            self.values[key] = new, tensor_meta(new, n.meta["tensor_meta"]) if "tensor_meta" in n.meta else None
        return self.values[key]

    def splice(self, op: torch.fx.Node) -> None:
        g = self.ep.graph
        i, prefix, bank, state, length = op.args
        t = self.templates[i]
        self.add_weights(i, t)
        tsig = t.ep.graph_signature
        inputs = [prefix, bank, *state, length]
        env = SymbolMap.bind(self.fake_mode, t.input_vals, [None if a is None else a.meta["val"] for a in inputs])
        weights = {**tsig.inputs_to_parameters, **tsig.inputs_to_buffers}
        user_args = iter(inputs)
        mapping: dict[torch.fx.Node, torch.fx.Node] = {}
        op_stack = op.meta.get("nn_module_stack", {})
        stacks: dict[int, dict] = {}
        traces: dict[tuple, str] = {}
        with g.inserting_before(op):
            for n in t.ep.graph.nodes:
                if n.op == "placeholder":
                    fqn = weights.get(n.name)
                    mapping[n] = self.by_fqn[f"model.layers.{i}.{fqn.removeprefix('layer.')}"] if fqn \
                        else next(user_args)
                    continue
                if n.op == "output":
                    outs = [mapping[a] for a in n.args[0]]
                    continue
                new = g.node_copy(n, mapping.__getitem__)
                if "val" in n.meta:
                    new.meta["val"], tm = self._value(t, n, env)
                    if tm is not None:
                        new.meta["tensor_meta"] = tm
                if "stack_trace" in n.meta and "stack_trace" in op.meta:
                    key = (id(op), n.meta["stack_trace"])
                    if key not in traces:
                        traces[key] = _join_traces(op.meta["stack_trace"], n.meta["stack_trace"])
                    new.meta["stack_trace"] = traces[key]
                if "nn_module_stack" in n.meta:
                    s = n.meta["nn_module_stack"]
                    if id(s) not in stacks:
                        stacks[id(s)] = _module_stack(op_stack, s, i)
                    new.meta["nn_module_stack"] = dict(stacks[id(s)])
                mapping[n] = new
        for user in list(op.users):
            if user.target is not _getitem:
                raise StampError(f"stamped trace: layer {i}'s stand-in is used by {user.target}")
            user.replace_all_uses_with(outs[user.args[1]])
            g.erase_node(user)
        g.erase_node(op)


def _size_pass(gm: torch.fx.GraphModule, shape_env: Any) -> None:
    """The pass torch.export ends with (torch._export.utils.apply_runtime_assertion_pass), with the node
    metadata it gives: one node per symbolic size (CSE), sizes read off the inputs, runtime asserts."""
    from torch._export.passes._node_metadata_hook import _node_metadata_hook, _set_node_metadata_hook
    from torch._export.utils import first_call_function_nn_module_stack

    where = 'File "torch/fx/passes/runtime_assert.py", line 24, in insert_deferred_runtime_asserts'
    with _set_node_metadata_hook(gm, functools.partial(_node_metadata_hook, metadata={"stack_trace": where})):
        insert_deferred_runtime_asserts(gm, shape_env, f"exported program: "
                                        f"{first_call_function_nn_module_stack(gm.graph)}", export=True)


def _rename(g: torch.fx.Graph) -> None:
    """Node names given afresh as torch.export gives them (`linear`, `linear_1`, ...): placeholders keep theirs,
    traced nodes are named in graph order, then the size computations its last pass made (as export does)."""
    ns = torch.fx.graph._Namespace()
    nodes = list(g.nodes)
    sizes = [n for n in nodes if n.op == "call_function" and _is_size_node(n)]
    traced = [n for n in nodes if n.op != "placeholder" and not (n.op == "call_function" and _is_size_node(n))]
    for n in nodes:
        if n.op == "placeholder":
            ns.create_name(n.name, n)
    for n in traced + sizes:
        n.name = ns.create_name(_base_name(n.name) if n.op != "output" else n.name, n)
    g._graph_namespace = ns


def _is_size_node(n: torch.fx.Node) -> bool:
    return isinstance(n.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat)) or \
        n.target in (torch.ops.aten._assert_scalar.default, torch.ops.aten.sym_constrain_range_for_size.default)


def _base_name(name: str) -> str:
    head, _, tail = name.rpartition("_")
    return head if head and tail.isdigit() else name


def _program(ep: ExportedProgram, model: K3ForCausalLM, splicer: _Splicer) -> ExportedProgram:
    """The spliced skeleton as torch.export would give `model`'s program: placeholders and input specs of every
    parameter then every buffer in module order, then the user inputs; output specs naming the output nodes;
    `model`'s state_dict."""
    g = ep.graph
    weights = [fqn for fqn, _ in model.named_parameters()] + [fqn for fqn, _ in model.named_buffers()]
    users = [s for s in ep.graph_signature.input_specs if s.target is None]
    names = {n.name: n for n in g.nodes if n.op == "placeholder"}
    order = [splicer.by_fqn[f] for f in weights] + [names[s.arg.name] for s in users if hasattr(s.arg, "name")]
    if len(order) != len(names):
        raise StampError(f"stamped trace: {len(names)} placeholders, {len(order)} inputs in the model")
    first = next(iter(g.nodes))
    for n in reversed(order):
        first.prepend(n)
        first = n
    outs = g.output_node().args[0]
    out_specs = [OutputSpec(s.kind, TensorArgument(a.name) if isinstance(s.arg, TensorArgument) else s.arg,
                            s.target) for s, a in zip(ep.graph_signature.output_specs, outs, strict=True)]
    sig = ExportGraphSignature([splicer.specs[f] for f in weights] + users, out_specs)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    calls = {e.fqn: e for e in ep.module_call_graph}
    calls = [calls.get(fqn) or ModuleCallEntry(fqn, None) for fqn, _ in model.named_modules()]
    # the program's GraphModule is built from `g` (and compiled) by ExportedProgram itself
    return ExportedProgram(root=ep.graph_module, graph=g, graph_signature=sig, state_dict=state,
                           range_constraints=ep.range_constraints, module_call_graph=calls,
                           example_inputs=ep.example_inputs, constants=ep.constants, verifiers=ep.verifiers)


def trace_stamped(model: K3ForCausalLM, *, dtype: torch.dtype | None = None,
                  cache: CacheOptions | None = None) -> ExportedProgram:
    """exporter/trace.trace's program (the per-layer trace), each distinct layer traced once (module docstring). StampError where a
    layer's shapes cannot be carried over."""
    from ..model.block import DecoderLayer

    if type(model) is not K3ForCausalLM or not all(type(x) is DecoderLayer for x in model.model.layers):
        raise StampError(f"stamped trace: {type(model).__name__} is not a K3ForCausalLM of decoder layers")
    p = next(model.parameters())
    dtype = dtype or p.dtype
    firsts: dict[tuple, int] = {}
    for i in range(model.cfg.num_layers):
        firsts.setdefault(layer_key(model, i), i)
    traced = {k: _trace_template(model, i, dtype, cache) for k, i in firsts.items()}
    templates = {i: traced[layer_key(model, i)] for i in range(model.cfg.num_layers)}
    ids, past = example_inputs(model.cfg, dtype=dtype, device=p.device, cache=cache)
    with _stand_ins(model, templates), torch.no_grad(), \
            torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
        skeleton = torch.export.export(model, (ids, past), dynamic_shapes=dynamic_shapes(model.cfg, cache))
    splicer = _Splicer(skeleton, templates)
    splicer.splice_all()
    _size_pass(skeleton.graph_module, splicer.fake_mode.shape_env)
    _rename(skeleton.graph)
    skeleton.graph.lint()
    return _program(skeleton, model, splicer)


def trace_recorded(model: K3ForCausalLM, *, dtype: torch.dtype | None = None, cache: CacheOptions | None = None,
                   mode: str = "stamped") -> tuple[ExportedProgram, dict]:
    """The program of `model` traced in `mode` (TRACE_MODES), and the manifest's `trace` entry: {"mode": the
    trace used, "fallback": why a stamped trace fell back to the per-layer one, or null}. Both modes give the
    same program (tests/exporter/test_stamp.py)."""
    if mode not in TRACE_MODES:
        raise ValueError(f"trace mode={mode!r}: must be one of {', '.join(TRACE_MODES)}")
    if mode == "stamped":
        try:
            return trace_stamped(model, dtype=dtype, cache=cache), {"mode": "stamped", "fallback": None}
        except StampError as e:
            return trace(model, dtype=dtype, cache=cache), {"mode": "per-layer", "fallback": str(e)}
    return trace(model, dtype=dtype, cache=cache), {"mode": "per-layer", "fallback": None}
