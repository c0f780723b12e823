"""ONNX Runtime GenAI package: `model.genai.onnx` + `genai_config.json` beside the ort model (`k3x export --target onnx`).

    import onnxruntime_genai as og
    model = og.Model(og.Config(export_dir))   # then og.Tokenizer(model), og.Generator(model, params)

How the k3x model meets GenAI's contract (onnxruntime-genai 0.18, its generic decoder-only pipeline):
- KDA state: GenAI finds recurrent layers by input name (`past_conv_names` / `past_recurrent_names`
  templates). k3x already names them `past.{i}.conv` / `past.{i}.recurrent` -> `present.{i}.*`, with
  the shapes GenAI allocates ([batch, 3P, W-1] and [batch, H, K, V]), so they pass through unchanged.
- MLA cache: GenAI allocates a key/value pair per attention layer as [batch, kv_heads, seq, head_size],
  one `head_size` for keys and values. The k3x cache is one latent [batch, seq, kv_lora + rope] per
  layer. It is presented as `past_key_values.{i}.key` / `.value` of one head each, holding the first
  and the second half of the latent (head_size = latent / 2): the graph concatenates the halves back
  into the latent on input and splits the present latent on output. Nothing is expanded to heads;
  the cache stays exactly the latent size. (A latent of odd width cannot be halved: refused.)
- The file is the ort flavor with only this I/O wrapping (Squeeze/Concat in, Split/Unsqueeze out),
  so ONNX Runtime runs the same k3 function bodies. Its weights: embedded (a copy of model.onnx's) for
  models under 2 GB, else references into the shared `model.onnx.data`.
- `genai_config.json`: model type "llama" selects GenAI's generic decoder-only pipeline; I/O name
  templates; token ids from the tokenizer / generation config; context length from the export's
  dynamic-dim bounds; greedy search defaults. BOS / EOS ids outside the vocabulary (or not integers:
  `Infinity`) skip the package with a note; the file is written with allow_nan=False. Without an EOS id (no tokenizer, no generation config) the
  package is skipped with a note: GenAI refuses a config without one. The provider list is empty (CPU); add CUDA with
  `config.append_provider("cuda")`.
- Static latent cache (`--max-context`): no package; the export notes why in one line (`STATIC_CACHE_NOTE`).
  GenAI's `past_present_share_buffer: true` preallocates [batch, kv_heads, max_length, head_size] and binds it
  as both the past input and the present output, but it tells the model the filled length only through its
  attention-mask / `seqlens_k` + `total_sequence_length` conventions (which of them depends on the model type
  and GenAI version), and relies on the attention op updating the buffer in place (GroupQueryAttention). The
  k3x graph takes a `past_length` scalar and scatters into a fresh output, so mapping it onto the shared buffer
  would be unverified on this machine (no onnxruntime-genai installed): refused rather than guessed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_ir as ir

from ..folder.dims import DYNAMIC_DIMS
from ..model.config import K3Config
from ..model.options import CacheOptions
from ..model.state import state_specs

GENAI_MODEL = "model.genai.onnx"
GENAI_CONFIG = "genai_config.json"
MODEL_TYPE = "llama"  # GenAI's generic decoder-only pipeline
KEY, VALUE = "past_key_values.%d.key", "past_key_values.%d.value"
PRESENT_KEY, PRESENT_VALUE = "present.%d.key", "present.%d.value"
STATIC_CACHE_NOTE = ("genai: skipped — a static latent cache (--max-context) has a past_length input that "
                     "onnxruntime-genai does not feed (its past_present_share_buffer needs GroupQueryAttention's "
                     "in-place KV update); export without --max-context for a GenAI package")


def _no_static_cache(model: ir.Model) -> None:
    if any(v.name == "past_length" for v in model.graph.inputs):
        raise ValueError(STATIC_CACHE_NOTE.removeprefix("genai: skipped — "))


def half_latent(cfg: K3Config) -> int:
    width = cfg.mla.latent_dim
    if width % 2:
        raise ValueError(f"mla latent width {width} (kv_lora_rank + qk_rope_head_dim) is odd: it cannot be presented "
                         "as GenAI's equal-size key/value pair")
    return width // 2


def _int64(graph: ir.Graph, name: str, values: list[int]) -> ir.Value:
    v = ir.Value(name=name, shape=ir.Shape([len(values)]), type=ir.TensorType(ir.DataType.INT64),
                 const_value=ir.tensor(np.array(values, dtype=np.int64), name=name))
    graph.register_initializer(v)
    return v


def wrap_for_genai(model: ir.Model, cfg: K3Config) -> None:
    """Rewrite the MLA latent I/O of an ort-flavor model into GenAI's key/value pairs, in place."""
    _no_static_cache(model)
    g, half = model.graph, half_latent(cfg)
    latent = {s.layer for s in state_specs(cfg) if s.kind == "latent"}
    axis1 = _int64(g, "genai.axis1", [1])
    halves = _int64(g, "genai.halves", [half, half])
    inputs, first, prologue = [], next(iter(g)), []
    for v in list(g.inputs):
        layer = int(v.name.split(".")[1]) if v.name.startswith("past_key_values.") else None
        if layer not in latent:
            inputs.append(v)
            continue
        key = ir.Value(name=KEY % layer, type=v.type, shape=ir.Shape(["batch", 1, "past_seq", half]))
        value = ir.Value(name=VALUE % layer, type=v.type, shape=ir.Shape(["batch", 1, "past_seq", half]))
        k, vv = ir.node("Squeeze", [key, axis1]), ir.node("Squeeze", [value, axis1])
        cat = ir.node("Concat", [k.outputs[0], vv.outputs[0]], attributes={"axis": -1})
        cat.outputs[0].name = f"genai.past_latent.{layer}"
        v.replace_all_uses_with(cat.outputs[0])
        prologue += [k, vv, cat]
        inputs += [key, value]
    g.insert_before(first, prologue)
    outputs = []
    for v in list(g.outputs):
        layer = int(v.name.split(".")[1]) if v.name.endswith(".latent") else None
        if layer not in latent:
            outputs.append(v)
            continue
        split = ir.node("Split", [v, halves], attributes={"axis": -1}, num_outputs=2)
        pair = [ir.node("Unsqueeze", [split.outputs[j], axis1]) for j in (0, 1)]
        for node in (split, *pair):
            g.append(node)
        v.name = f"genai.present_latent.{layer}"
        for node, template in zip(pair, (PRESENT_KEY, PRESENT_VALUE)):
            out = node.outputs[0]
            out.name, out.type, out.shape = template % layer, v.type, ir.Shape(["batch", 1, "total_seq", half])
            outputs.append(out)
    g.inputs.clear()
    g.inputs.extend(inputs)
    g.outputs.clear()
    g.outputs.extend(outputs)


def genai_config(cfg: K3Config, bos: int | None, eos: tuple[int, ...]) -> dict:
    context = min(cfg.max_position_embeddings, DYNAMIC_DIMS["past_seq"].max)
    eos_value: int | list[int] = list(eos) if len(eos) > 1 else eos[0]
    return {
        "model": {
            "type": MODEL_TYPE,
            "bos_token_id": -1 if bos is None else bos,
            "eos_token_id": eos_value,
            "pad_token_id": eos[0],
            "context_length": context,
            "vocab_size": cfg.vocab_size,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": GENAI_MODEL,
                "head_size": half_latent(cfg),
                "hidden_size": cfg.hidden_size,
                "num_attention_heads": 1,
                "num_key_value_heads": 1,
                "num_hidden_layers": cfg.num_layers,
                "inputs": {"input_ids": "input_ids", "past_key_names": KEY, "past_value_names": VALUE,
                           "past_conv_names": "past.%d.conv", "past_recurrent_names": "past.%d.recurrent"},
                "outputs": {"logits": "logits", "present_key_names": PRESENT_KEY, "present_value_names": PRESENT_VALUE,
                            "present_conv_names": "present.%d.conv", "present_recurrent_names": "present.%d.recurrent"},
            },
        },
        "search": {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": context,
                   "min_length": 0, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0,
                   "length_penalty": 1.0, "diversity_penalty": 0.0, "no_repeat_ngram_size": 0,
                   "early_stopping": True, "past_present_share_buffer": False},
    }


def _token_ids(out_dir: Path) -> tuple[int | None, tuple[int, ...]]:
    from ..text.tokenizer import eos_token_ids, find_tokenizer, read_json

    tok = find_tokenizer(out_dir)
    eos = tok.eos_token_ids if tok else eos_token_ids(out_dir)
    bos = None
    gen = out_dir / "generation_config.json"
    if gen.is_file():
        bos = read_json(gen).get("bos_token_id")
    if bos is None and tok is not None and tok.special_token("bos_token"):
        bos = tok.backend.token_id(tok.special_token("bos_token"))
    return bos, tuple(eos)


def _outside_vocab(cfg: K3Config, bos: object, eos: tuple[int, ...]) -> str | None:
    """`name=value` of the first BOS / EOS id that is not a token of the model (GenAI would index past its
    logits), else None."""
    for name, tid in [("bos_token_id", bos)] + [("eos_token_id", e) for e in eos]:
        if tid is not None and (isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < cfg.vocab_size):
            return f"{name}={repr(tid)[:40]}"
    return None


def genai_stage(out_dir: Path, cfg: K3Config, ort_file: str, final_dir: Path | None = None,
                cache: CacheOptions | None = None) -> str:
    """Write `model.genai.onnx` + `genai_config.json` into the export folder as artifact `genai` (after the
    onnx artifact and the tokenizer files are in place). `final_dir`: where the folder will be once the staged
    export is renamed into place (named in the returned line)."""
    from ..folder.artifacts import write_artifact

    out_dir = Path(out_dir)
    shown = Path(final_dir or out_dir)
    if cache is not None and cache.static:
        return STATIC_CACHE_NOTE
    half_latent(cfg)  # refuse before reading the model
    bos, eos = _token_ids(out_dir)
    if not eos:  # GenAI refuses a config without an EOS id in the vocabulary
        return (f"genai: skipped — no EOS id in {shown} (export from a checkpoint with a tokenizer or "
                "generation_config.json to get an onnxruntime-genai package)")
    bad = _outside_vocab(cfg, bos, eos)
    if bad:
        return (f"genai: skipped — {bad} in {shown} is not a token id of the model (vocab_size={cfg.vocab_size}); "
                "fix generation_config.json / the tokenizer files for an onnxruntime-genai package")
    model = ir.load(out_dir / ort_file)
    wrap_for_genai(model, cfg)
    with write_artifact(out_dir, "genai", {"runtime": "onnxruntime-genai", "model_type": MODEL_TYPE},
                        primary=GENAI_CONFIG) as tmp:
        ir.save(model, tmp / GENAI_MODEL)  # external tensors stay references into model.onnx.data
        (tmp / GENAI_CONFIG).write_text(json.dumps(genai_config(cfg, bos, eos), indent=2, allow_nan=False) + "\n")
    return f"genai: {shown / GENAI_CONFIG} (og.Model({str(shown)!r}))"
