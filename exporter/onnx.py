"""Stage 2: ExportedProgram -> ONNX with one `k3::<Op>` node per custom op, then flavors.

One export, two files (exporter/onnx_flavors.py):
  - `model.onnx`      flavor `ort`: the k3 nodes get function bodies (standard ops + com.microsoft::
                      LinearAttention), so ONNX Runtime runs it with no extra library;
  - `model.trt.onnx`  flavor `trt`: bare plugin nodes for TensorRT.

Notable choices:
- Custom translations (`custom_translation_table`, keyed by OpOverload, one per registered op family:
  custom_ops/<family>/onnx.py) emit plain custom-domain nodes whose attributes are the op's static
  hyper-parameters and static dims (the family's `NODE` spec).
  Function bodies are attached after export, because torch.onnx inlines every local function.
- I/O names follow ONNX Runtime GenAI's conventions (`input_ids`, `past.{i}.*` / `past_key_values.{i}.latent` -> `logits`,
  `present.{i}.*`); the exporter's symbolic dims are renamed to `batch`, `seq`, `past_seq` (from
  folder/dims.DYNAMIC_DIMS) and `present.{i}.latent` gets `total_seq`.
- No onnxscript optimizer by default: initializers keep their state_dict names (refit, external data
  pointing into checkpoints) and weights are not re-laid-out; ONNX Runtime folds constants itself at
  session creation (measured: k3-mini decode no slower without it). Two small passes instead:
  SplitToSequence/SequenceAt -> Split (no bf16 type otherwise) and constant folding of everything that
  reads no weight (TensorRT's parser needs e.g. ReduceMean axes as build-time constants).
- Opset 23 (bfloat16 Conv needs >= 22): a bf16 graph passes onnx.checker.
- Weights: initializers named like the state_dict; a model over 2 GB stores them once in
  `model.onnx.data`, shared by both flavor files. `weights=False` (meta-device models such as the full
  `k3`): no optimizer (it would read constant values) and every weight becomes a graph input.
- Layer functions (`layer_functions`, default on; exporter/onnx_functions.py): each flavor file holds one local
  function per layer kind, called once per layer with its weights as inputs; the flat graph where the layers
  do not fit, the reason in the manifest entry's `layer_functions` (flavor -> mode, fallback, calls per kind).
- Deterministic: the same program gives byte-identical files (tests/exporter/test_onnx_export.py); the
  exporter's per-node metadata (Python stack traces with absolute paths, fx node text) is dropped.
"""

from __future__ import annotations

import logging
import warnings
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import onnx_ir as ir
import torch
from torch.export import ExportedProgram

from ..folder.dims import DYNAMIC_DIMS
from ..model.config import K3Config
from ..model.options import CacheOptions
from ..model.state import state_specs
from ..plan.onnx_node import DOMAIN
from .onnx_flavors import FLAVOR_PASSES
from .onnx_rewrites import fuse_latent_attention, fuse_situ_glu, merge_sibling_gemms, rsqrt_as_div
from .onnx_rewrites_kda import fuse_kda_short_conv
from .onnx_functions import save as save_layers

FLAVOR_FILES: dict[str, str] = {"ort": "model.onnx", "trt": "model.trt.onnx"}
EXTERNAL_DATA = "model.onnx.data"
EXTERNAL_DATA_THRESHOLD = 2 * 1024**3  # protobuf's 2 GB limit
TOTAL_SEQ = "total_seq"
OPSET_IMPORTS = "k3x.opset_imports"  # model.meta key (not serialised)
REFERENCED = "checkpoint"  # an artifact's `weights` when they are read from the checkpoint at load

@dataclass(frozen=True)
class OnnxOptions:
    flavors: tuple[str, ...] = ("ort", "trt")
    weights: bool = True  # False: graph only (meta device), weights become graph inputs
    optimize: bool = False  # onnxscript optimizer; off by default, always off without weights
    external_data: bool | None = None  # None: only when the weights exceed 2 GB
    opset: int = 23  # >= 22 for bfloat16 Conv; ORT 1.31 runs it
    # weights streamed from a checkpoint (exporter/onnx_weights.py) into a meta-traced program's export
    weight_stream: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None
    cache: CacheOptions | None = None  # the latent cache interface traced (None: growing)
    serving: dict | None = None  # the manifest's `serving` entry: a serving step's I/O names (exporter/serving.py)
    reference: bool = False  # weights read from the checkpoint at load (exporter/onnx_weights.reference_weights)
    layer_functions: bool = True  # each layer kind one local function, called per layer (exporter/onnx_functions.py)

    def __post_init__(self) -> None:
        bad = [f for f in self.flavors if f not in FLAVOR_FILES]
        if bad or not self.flavors:
            raise ValueError(f"flavors={self.flavors!r}: choose from {sorted(FLAVOR_FILES)}")


@dataclass
class OnnxArtifact:
    files: dict[str, Path]  # flavor -> model file
    external_data: Path | None
    num_nodes: int
    op_counts: dict[str, int] = field(default_factory=dict)
    collectives: dict[str, int] = field(default_factory=dict)  # AllReduce / AllGather nodes (rank programs)
    digests: dict[str, str] = field(default_factory=dict)  # file name -> sha256 taken while writing
    layer_functions: dict[str, dict] = field(default_factory=dict)  # flavor -> onnx_functions.save's entry
    io: dict[str, dict] = field(default_factory=dict)  # flavor -> graph_io: each input's / output's dtype and shape


# --- custom translations: torch.ops.k3.<family> -> k3::<Op> nodes (attributes = plugin fields) ---------

def translation_table() -> dict:
    """OpOverload -> translation, one per registered op family (custom_ops/<family>/onnx.translate)."""
    from ..custom_ops.registry import families
    from .onnx_collectives import translation_table as collectives

    return {f.overload: f.onnx.translate for f in families()} | collectives()


# --- I/O names and dims ------------------------------------------------------------------------------

def _rename_io(model: ir.Model, cfg: K3Config, cache: CacheOptions | None) -> None:
    g = model.graph
    specs = state_specs(cfg, cache)
    inputs = list(g.inputs)[: 1 + len(specs)]
    outputs = list(g.outputs)
    if len(inputs) != 1 + len(specs) or len(outputs) != 1 + len(specs):
        raise ValueError(f"exported graph has {len(g.inputs)} inputs / {len(outputs)} outputs; "
                         f"expected {1 + len(specs)} each for config {cfg.name!r}")
    # symbol -> dim name of folder/dims.DYNAMIC_DIMS, read off the inputs the exporter produced
    sym = {str(inputs[0].shape[0]): "batch", str(inputs[0].shape[1]): "seq"}
    for s, v in zip(specs, inputs[1:]):
        if s.dims[1:2] == ("past_seq",):
            sym[str(v.shape[1])] = "past_seq"
    assert set(sym.values()) <= set(DYNAMIC_DIMS), sym
    pattern = re.compile(r"\b(" + "|".join(re.escape(k) for k in sorted(sym, key=len, reverse=True)) + r")\b")

    def rename(v: ir.Value) -> None:
        if v.shape is not None and any(isinstance(d, ir.SymbolicDim) for d in v.shape):
            v.shape = ir.Shape([ir.SymbolicDim(pattern.sub(lambda m: sym[m.group(1)], d.value))
                                if isinstance(d, ir.SymbolicDim) and d.value else d for d in v.shape])

    for v in g.inputs:
        rename(v)
    for node in ir.traversal.RecursiveGraphIterator(g):
        for v in node.outputs:
            rename(v)
    inputs[0].name = "input_ids"
    outputs[0].name = "logits"
    vocab = outputs[0].shape[-1] if outputs[0].shape is not None else cfg.vocab_size  # a TP rank's logits: whole vocab
    outputs[0].shape = ir.Shape(["batch", "seq", vocab])
    for s, vin, vout in zip(specs, inputs[1:], outputs[1:]):
        vin.name, vout.name = s.input_name, s.output_name
        if s.dims[1:2] == ("past_seq",):
            vout.shape = ir.Shape(["batch", TOTAL_SEQ, *vout.shape[2:]])


def _module_path(scopes: list[str]) -> str:
    """['', 'model', 'model.layers.3', 'model.layers.3.block_sparse_moe', 'moe'] -> 'model/layers.3/block_sparse_moe'
    (the deepest module; a numeric part stays with its list's name)."""
    modules = [x for x in scopes[:-1] if x]
    parts: list[str] = []
    for p in (modules[-1].split(".") if modules else []):
        if p.isdigit() and parts:
            parts[-1] += f".{p}"
        else:
            parts.append(p)
    return "/".join(parts)


def _name_nodes(graph: ir.Graph) -> None:
    """Hierarchical node names from the module each node came from (`/model/layers.3/block_sparse_moe/MoE`,
    `/model/layers.0/self_attn/MatMul_2`), so a profile or a Netron view maps back to the model."""
    import ast

    seen: dict[str, int] = {}
    for node in graph:
        raw = node.metadata_props.get("pkg.torch.onnx.name_scopes")
        scopes = ast.literal_eval(raw) if raw else []
        base = f"/{_module_path(scopes)}/{node.op_type}".replace("//", "/")
        n = seen.get(base, 0)
        seen[base] = n + 1
        node.name = base if n == 0 else f"{base}_{n}"


def _split_sequences_to_split(graph: ir.Graph) -> None:
    """SplitToSequence(x, const sizes) read only by SequenceAt(const i) -> one Split node.

    torch.split lowers to the sequence form without the onnxscript optimizer; SplitToSequence has no
    bfloat16 type, so a bf16 graph would fail onnx.checker (and TensorRT handles Split better anyway).
    """
    for node in [n for n in graph if n.op_type == "SplitToSequence" and n.domain == ""]:
        sizes = ir.convenience.get_const_tensor(node.inputs[1]) if len(node.inputs) > 1 else None
        uses = list(node.outputs[0].uses())
        if sizes is None or sizes.numpy().ndim != 1 or node.outputs[0].is_graph_output() or any(
                u.node.op_type != "SequenceAt" or ir.convenience.get_const_tensor(u.node.inputs[1]) is None
                for u in uses):
            continue
        n = len(sizes.numpy())
        axis = node.attributes["axis"].as_int() if "axis" in node.attributes else 0
        split = ir.node("Split", [node.inputs[0], node.inputs[1]], {"axis": axis}, num_outputs=n,
                        name=f"{node.name}_split")
        graph.insert_before(node, split)
        for u in uses:
            at = u.node
            pos = int(ir.convenience.get_const_tensor(at.inputs[1]).numpy()) % n
            ir.convenience.replace_all_uses_with(at.outputs[0], split.outputs[pos])
            graph.remove(at, safe=True)
        graph.remove(node, safe=True)


def _fold_constants(model: ir.Model, weights: set[str]) -> None:
    """Fold shape/axes arithmetic on constants (e.g. Reshape(Constant, Constant) feeding ReduceMean's
    axes, which TensorRT's parser needs as a build-time constant), never a node that reads a weight:
    weights keep their state_dict names and may be meta tensors."""
    from onnxscript.optimizer import _constant_folding

    def reads_weight(node: ir.Node) -> bool | None:
        return False if any(v is not None and v.name in weights for v in node.inputs) else None

    _constant_folding.fold_constants(model, should_fold=reads_weight)


def _weights_to_inputs(model: ir.Model, weights: set[str]) -> None:
    """Meta-device weights: move each weight initializer to the graph inputs (name, dtype, shape kept);
    constants the exporter or the folding made (real values) stay initializers."""
    g = model.graph
    values = [v for name, v in g.initializers.items() if name in weights]
    for v in values:
        del g.initializers[v.name]
        v.const_value = None
    g.inputs.extend(values)


def to_onnx_ir(ep: ExportedProgram, cfg: K3Config, *, weights: bool = True, optimize: bool = False,
               opset: int = 23, cache: CacheOptions | None = None, serving: dict | None = None) -> ir.Model:
    """torch.export program -> onnx_ir model with bare k3 nodes and GenAI-style I/O (the `trt` flavor)."""
    for name in ("onnx_ir", "onnxscript"):  # their passes log every clean-up / skipped fold at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    # "torchvision is not installed. Skipping torchvision::nms" and the like: nothing k3x uses
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings():  # torch-internal deprecation noise (pytree LeafSpec) on every export
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        prog = torch.onnx.export(ep, dynamo=True, custom_translation_table=translation_table(),
                                 optimize=optimize and weights, opset_version=opset, verbose=False)
    model = prog.model
    _name_nodes(model.graph)
    for node in ir.traversal.RecursiveGraphIterator(model.graph):  # stack traces, fx names: size, paths
        node.metadata_props.clear()
        for v in node.outputs:
            v.metadata_props.clear()
    _split_sequences_to_split(model.graph)
    weight_names = set(ep.state_dict) | set(ep.constants)
    _fold_constants(model, weight_names)
    rsqrt_as_div(model)  # RMSNorm in the form ONNX Runtime fuses (exporter/onnx_rewrites.py), every flavor alike
    merge_sibling_gemms(model)  # KDA's q, k, v projections as one Gemm (exporter/onnx_rewrites.py)
    fuse_situ_glu(model)  # the dense FFN's / shared experts' SiTU-GLU as one k3x.fused::SiTUGLU call
    fuse_latent_attention(model)  # MLA's attention over the latent as one k3x.fused::LatentAttention call
    fuse_kda_short_conv(model)  # KDA's conv, SiLU and q/k norm as one k3x.fused::KDAShortConv call
    ir.passes.common.RemoveUnusedNodesPass()(model)  # SequenceAt positions, folded Constants
    if serving is None:
        _rename_io(model, cfg, cache)
    else:
        from .serving import rename_serving_io

        rename_serving_io(model, serving)
    if not weights:
        _weights_to_inputs(model, weight_names)
    model.meta[OPSET_IMPORTS] = dict(model.opset_imports)  # as converted: each flavor pass starts from these
    model.producer_name, model.producer_version = "k3x", "0.1.0"
    model.metadata_props["k3x.config"] = cfg.name
    model.metadata_props["k3x.config_hash"] = cfg.hash()
    return model


def graph_io(model: ir.Model) -> dict[str, list[dict]]:
    """{"inputs": [...], "outputs": [...]}: each graph input's and output's name, dtype (numpy's name: int64,
    float32, bfloat16) and shape (ints for static dims, the dim's name for a dynamic one, None when unnamed), as
    ONNX Runtime's InferenceSession reports them: what a user's own ONNX Runtime loop must feed and expect."""
    def entry(v: ir.Value) -> dict:
        shape = None if v.shape is None else [d if isinstance(d, int) else d.value for d in v.shape]
        return {"name": v.name, "dtype": v.dtype.numpy().name, "shape": shape}

    return {"inputs": [entry(v) for v in model.graph.inputs], "outputs": [entry(v) for v in model.graph.outputs]}


def _weight_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def export_onnx(ep: ExportedProgram, cfg: K3Config, out_dir: Path, options: OnnxOptions = OnnxOptions(),
                model: ir.Model | None = None) -> OnnxArtifact:
    """Write one file per flavor into `out_dir` (which must exist; the caller owns atomicity). `model`: `ep`
    already converted by `to_onnx_ir` (rank programs: converted once, each rank's weights swapped in)."""
    from collections import Counter

    out_dir = Path(out_dir)
    streamed = options.weights and options.weight_stream is not None
    if model is None:
        model = to_onnx_ir(ep, cfg, weights=options.weights and not streamed and not options.reference,
                           optimize=options.optimize,
                           opset=options.opset, cache=options.cache, serving=options.serving)
    external = options.external_data
    if external is None:
        external = _weight_bytes(model) > EXTERNAL_DATA_THRESHOLD
    data_path, digests = None, {}
    if options.reference:
        from .onnx_weights import reference_weights

        reference_weights(model, set(ep.state_dict) | set(ep.constants))
    elif streamed:
        from .onnx_weights import attach_streamed_weights

        data_path, digests[EXTERNAL_DATA] = attach_streamed_weights(model, out_dir, EXTERNAL_DATA,
                                                                    options.weight_stream(),
                                                                    set(ep.state_dict) | set(ep.constants))
    elif external and options.weights:  # one data file, referenced by every flavor file
        # small tensors (shape constants ORT must read during shape inference) stay in the graph
        ir.external_data.unload_from_model(model, out_dir, EXTERNAL_DATA, size_threshold_bytes=1024)
        data_path = out_dir / EXTERNAL_DATA
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)] if options.layer_functions else None
    layer_functions, io = {}, {}
    for flavor in ("trt", "ort"):  # trt first: the ort pass adds functions to the same model
        if flavor in options.flavors:
            model.opset_imports.clear()  # a model written before (rank programs) carries the last pass's imports
            model.opset_imports.update(model.meta.get(OPSET_IMPORTS, {}))
            FLAVOR_PASSES[flavor](model)
            io[flavor] = graph_io(model)
            layer_functions[flavor] = save_layers(model, out_dir / FLAVOR_FILES[flavor], kinds,
                                                  set(ep.state_dict) | set(ep.constants))
    files = {f: out_dir / FLAVOR_FILES[f] for f in FLAVOR_FILES if f in options.flavors}
    counts = Counter(f"{n.domain}::{n.op_type}" for n in model.graph if n.domain == DOMAIN)
    from .onnx_collectives import counts as collective_counts

    return OnnxArtifact(files=files, external_data=data_path, num_nodes=len(model.graph),
                        op_counts=dict(sorted(counts.items())), collectives=collective_counts(model),
                        digests=digests, layer_functions=layer_functions, io=io)


def onnx_stage(out_dir: Path, ep: ExportedProgram, cfg: K3Config, options: OnnxOptions = OnnxOptions(),
               model: ir.Model | None = None) -> OnnxArtifact:
    """Export into the export folder `out_dir` (manifest already initialised) as artifact `onnx`.

    Files land atomically through folder/artifacts.write_artifact; the manifest entry records which
    file is which flavor (`flavors`), the external data file, the opset, the k3 node counts and each flavor
    file's inputs and outputs with their dtypes and shapes (`io`: graph_io).
    """
    from ..folder.artifacts import write_artifact

    extra: dict = {}
    digests: dict[str, str] = {}
    with write_artifact(out_dir, "onnx", extra, digests=digests) as tmp:
        art = export_onnx(ep, cfg, tmp, options, model)
        digests.update(art.digests)
        extra.update(flavors={f: p.name for f, p in art.files.items()}, opset=options.opset,
                     weights=REFERENCED if options.reference else options.weights,
                     external_data=art.external_data.name if art.external_data else None,
                     nodes=art.num_nodes, k3_nodes=art.op_counts, layer_functions=art.layer_functions,
                     io=art.io)
        if art.collectives:  # the ort flavor needs onnxruntime-extensions' Python ops (onnx_collectives.py)
            extra["collectives"] = art.collectives
    files = {f: Path(out_dir) / p.name for f, p in art.files.items()}
    data = Path(out_dir) / art.external_data.name if art.external_data else None
    return OnnxArtifact(files=files, external_data=data, num_nodes=art.num_nodes, op_counts=art.op_counts,
                        collectives=art.collectives, layer_functions=art.layer_functions, io=art.io)
