"""A sequence's state in a file, to hand it from one process to another (issue 21): prefill on one machine,
decode on another, with the same tokens and bit-identical logits.

    k3x run EXPORT --prompt-ids 1,2,3 --max-new-tokens 1 --save-state s.safetensors   # prefill here
    k3x run EXPORT --load-state s.safetensors --max-new-tokens 16                      # decode anywhere

The file is safetensors (raw tensors and a JSON header: nothing is unpickled), one sequence's state in its
per-sequence form (model/state_contract.py: the batch / slot axis dropped), interface-neutral:
- `layer.{i}.kda_conv` [3P, W-1] fp32, `layer.{i}.kda_recurrent` [H, K, V] fp32, `layer.{i}.mla_latent`
  [positions, kv_lora + rope] (static latent cache: [max_context, ...] and `length`), exactly the bytes the
  runner returned;
- `tokens` int64 [T]: the sequence the state holds (T = positions); `logits` fp32 [vocab]: its last
  position's logits, from which the next token is chosen;
- metadata: `format` (k3x-state), `version`, `config_hash`, the state `contract` of the export that wrote it,
  and the `rank`, `world` and `plan` of the program that wrote it (`Shard`; one program: rank 0 of 1).
Rank programs (a `--serving --tp/--ep` export): every rank writes and reads its own file, `FILE.rank{r}of{W}`
(`shard_path`), holding its pools' rows under its own contract (its KDA heads, the replicated latent); a file
is refused by a program of another rank, rank count or plan.
Loading checks the file against the loading export's contract (layer, kind, shape per sequence, axes, dtype)
and config hash before any tensor is used: every problem is a `StateFileError`, one line naming the file and
the tensor or field. A serving export (`serving_hooks`) writes and reads the same file: its slot's KDA rows and
the sequence's latent rows from its blocks, per sequence as the contract names them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..fileio import OutputError, check_output, write_output
from ..model.state_contract import tensor_label
from ..plan.dtypes import dtype_name, torch_dtype
from .base import Feeds, RunnerError

FORMAT, VERSION = "k3x-state", "1"
_SAME = ("layer", "kind", "shape", "axes", "dtype")  # what a state must agree on, whatever the interface


@dataclass(frozen=True)
class Shard:
    """Which program of an export writes or reads a state file (one program: rank 0 of 1)."""
    rank: int = 0
    world: int = 1
    plan: str = "tp=1 ep=1"

    def meta(self) -> dict[str, str]:
        return {"rank": str(self.rank), "world": str(self.world), "plan": self.plan}

    def describe(self, meta: dict[str, str]) -> str:
        return f"rank {meta['rank'][:8]} of {meta['world'][:8]} ({meta['plan'][:24]})"


def shard_path(path: Path, shard: Shard) -> Path:
    """The file of `shard` for the state file `path` the user named (one program: `path` itself)."""
    return Path(path) if shard.world == 1 else Path(f"{path}.rank{shard.rank}of{shard.world}")


class StateFileError(RunnerError):
    """A state file cannot be written or does not fit the export that loads it; one line naming the file."""


@dataclass(frozen=True)
class SavedState:
    tokens: list[int]  # the sequence the state holds
    outputs: Feeds  # as the runner returned them (batch of one): `logits` [1, 1, vocab] and the state outputs


def _key(t: dict[str, Any]) -> str:
    return "length" if t["kind"] == "length" else f"layer.{t['layer']}.{t['kind']}"


def _per_sequence(t: dict[str, Any], x: Tensor) -> Tensor:
    return x if t["kind"] == "length" else x[0]  # the static cache's length is one scalar for the batch


def save_state(path: Path, contract: dict[str, Any], config_hash: str, outputs: Feeds, tokens: list[int],
               shard: Shard = Shard()) -> None:
    """Write the state of a batch of one (`outputs` of the step that consumed `tokens`) to `path`, renamed into
    place once complete."""
    from safetensors.torch import save

    tensors = {_key(t): _per_sequence(t, outputs[t["output"]]).detach().cpu().contiguous() for t in contract["tensors"]}
    tensors["tokens"] = torch.tensor(tokens, dtype=torch.int64)
    tensors["logits"] = outputs["logits"][0, -1].detach().float().cpu().contiguous()
    meta = {"format": FORMAT, "version": VERSION, "config_hash": config_hash, "contract": json.dumps(contract),
            **shard.meta()}
    try:  # the one rule for a file the user named (fileio.write_output)
        write_output(Path(path), save(tensors, metadata=meta), flag="--save-state")
    except OutputError as e:
        raise StateFileError(str(e)) from None


def _read(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise StateFileError(f"{path}: not a k3x state file (safetensors: {str(e)[:200]})") from None


def _contract_problem(recorded: str | None, contract: dict[str, Any]) -> str | None:
    try:
        theirs = json.loads(recorded or "")["tensors"]
        mine = contract["tensors"]
        if len(theirs) != len(mine):
            return f"its contract has {len(theirs)} state tensors, this export's {len(mine)}"
        for t, m in zip(theirs, mine):
            for key in _SAME:
                if t.get(key) != m[key]:
                    return f"{tensor_label(m)}: its contract says {key}={str(t.get(key))[:60]}, this export's {m[key]}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return "its contract metadata is not a k3x state contract"
    return None


def _tensor_problem(t: dict[str, Any], x: Tensor | None, positions: int) -> str | None:
    if x is None:
        return "missing"
    shape = [positions if d == "position" else d for d in t["shape"]]
    if list(x.shape) != shape:
        return f"shape {list(x.shape)}, the export's contract says {shape}"
    if x.dtype != torch_dtype(t["dtype"]):
        return f"dtype {dtype_name(x.dtype)}, the export's contract says {t['dtype']}"
    return None


def load_state(path: Path, contract: dict[str, Any], config_hash: str, vocab_size: int,
               shard: Shard = Shard()) -> SavedState:
    """The state in `path`, checked against the loading program's `shard`, `contract` and config hash, as the
    outputs a runner would have returned (batch of one)."""
    tensors, meta = _read(Path(path))
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise StateFileError(f"{path}: not a k3x state file (format {str(meta.get('format'))[:40]!r}, version "
                             f"{str(meta.get('version'))[:10]!r}; this k3x reads {FORMAT!r} {VERSION})")
    theirs = {k: str(meta.get(k, v)) for k, v in Shard().meta().items()}
    if theirs != shard.meta():
        raise StateFileError(f"{path}: saved by {shard.describe(theirs)}, loaded by {shard.describe(shard.meta())}")
    if meta.get("config_hash") != config_hash:
        raise StateFileError(f"{path}: saved by an export of another model (config_hash "
                             f"{str(meta.get('config_hash'))[:16]}, this export's {config_hash[:16]})")
    problem = _contract_problem(meta.get("contract"), contract)
    if problem:
        raise StateFileError(f"{path}: {problem}")
    tokens, logits = tensors.get("tokens"), tensors.get("logits")
    if tokens is None or tokens.dtype != torch.int64 or tokens.dim() != 1 or not tokens.numel() \
            or int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise StateFileError(f"{path}: tokens: need int64 [T], T >= 1, ids in [0, {vocab_size})")
    if logits is None or logits.dtype != torch.float32 or list(logits.shape) != [vocab_size]:
        raise StateFileError(f"{path}: logits: need float32 [{vocab_size}]")
    extra = sorted(set(tensors) - {"tokens", "logits"} - {_key(t) for t in contract["tensors"]})
    if extra:
        raise StateFileError(f"{path}: {extra[0][:60]}: not a tensor of this export's state contract")
    outputs = {"logits": logits[None, None]}
    for t in contract["tensors"]:
        x = tensors.get(_key(t))
        problem = _tensor_problem(t, x, tokens.numel())
        if problem:
            raise StateFileError(f"{path}: {_key(t)}: {problem}")
        outputs[t["output"]] = x if t["kind"] == "length" else x[None]
    return SavedState(tokens.tolist(), outputs)


def state_hooks(save: Path | None, load: Path | None, contract: dict[str, Any], cfg, prompt: list[int],
                shard: Shard = Shard()) -> tuple[list[int], dict[str, Any]]:
    """(the sequence to decode, runners.generate's `start` / `on_prefill`) of `k3x run --save-state / --load-state`:
    decode from the state in `load` (its tokens replace `prompt`), and/or write the state after the prefill
    to `save` (rank programs: this rank's files of them, `shard_path`)."""
    hooks: dict[str, Any] = {}
    if load is not None:
        saved = load_state(shard_path(load, shard), contract, cfg.hash(), cfg.vocab_size, shard)
        prompt, hooks["start"] = saved.tokens, saved.outputs
    if save is not None:
        tokens, file = list(prompt), shard_path(save, shard)
        try:  # before any runner loads
            check_output(file, flag="--save-state")
        except OutputError as e:
            raise StateFileError(str(e)) from None
        hooks["on_prefill"] = lambda outputs: save_state(file, contract, cfg.hash(), outputs, tokens, shard)
    return prompt, hooks


def serving_hooks(save: Path | None, load: Path | None, contract: dict[str, Any], cfg, prompt: list[int],
                  shard: Shard = Shard()) -> tuple[list[int], dict[str, Any]]:
    """`state_hooks` for a serving export: (the prompt, runtime/serve.serve's `resume` / `on_prefill` for
    prompt 0). The file is the same (per-sequence tensors named by the contract): the slot's KDA rows and the
    sequence's latent rows map to the contract's `input` pool names."""
    from .serve import SlotState

    prompt, hooks = state_hooks(save, load, contract, cfg, prompt, shard)
    out: dict[str, Any] = {}
    if "start" in hooks:
        saved = hooks["start"]
        out["resume"] = {0: SlotState(prompt, {t["input"]: saved[t["output"]][0] for t in contract["tensors"]},
                                      saved["logits"][0, -1])}
    if "on_prefill" in hooks:
        write = hooks["on_prefill"]
        out["on_prefill"] = lambda i, state: write({"logits": state.logits[None, None], **{
            t["output"]: state.rows[t["input"]][None] for t in contract["tensors"]}})
    return prompt, out
