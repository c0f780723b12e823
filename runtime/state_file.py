"""A sequence's state in a file, to hand it from one process to another: prefill on one machine,
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
- metadata: `format` (k3x-state), `version`, `config_hash`, `weights` (the weights the state was computed
  with, `weights_origin`: the checkpoint hash the export recorded, else a digest of its artifacts' sha256s, so
  a state of another export of the same architecture is refused), the state `contract` of the export that
  wrote it, and the `rank`, `world` and `plan` of the program that wrote it (`Shard`; one program: rank 0 of 1).
Rank programs (a `--serving --tp/--ep` export): every rank writes and reads its own file, `FILE.rank{r}of{W}`
(`shard_path`), holding its pools' rows under its own contract (its KDA heads, the replicated latent); a file
is refused by a program of another rank, rank count or plan.
Loading opens the path once without blocking and reads it only when it is a regular file no larger than a
state of the export's context can be (a FIFO, device or folder is refused, never waited on), parses the
bytes it read (nothing is mapped or opened again), then checks the file against the loading export's
contract (layer, kind, shape per sequence, axes, dtype), config hash and weights, the sequence's length
against the model's context and every float value finite, before any tensor is used: every problem is a
`StateFileError`, one line naming the file and the tensor or field. A serving export (`serving_hooks`)
writes and reads the same file: its slot's KDA rows and the sequence's latent rows from its blocks, per
sequence as the contract names them.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..fileio import OutputError, check_output, write_output
from ..model.state_contract import tensor_label
from ..plan.dtypes import dtype_name, torch_dtype
from .base import Feeds, RunnerError

FORMAT, VERSION = "k3x-state", "2"  # 2: the `weights` origin recorded
_HEADER_ROOM = 1 << 20  # a state file's safetensors header and metadata, beyond the contract's own JSON
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


def weights_origin(manifest: dict[str, Any]) -> str:
    """What identifies an export's weights: the checkpoint hash its manifest records (any artifact, copied or
    referenced weights), else a digest of every artifact's sha256 and the rank programs' entries (an export
    of initialised weights: its files are its weights)."""
    ckpt = manifest.get("checkpoint")
    if isinstance(ckpt, dict) and isinstance(ckpt.get("hash"), str):
        return f"checkpoint {ckpt['hash']}"
    files = {name: [f.get("sha256") for f in entry.get("files", [])]
             for name, entry in (manifest.get("artifacts") or {}).items() if isinstance(entry, dict)}
    blob = json.dumps([files, manifest.get("parallel")], sort_keys=True, default=str).encode()
    return f"artifacts {hashlib.sha256(blob).hexdigest()[:16]}"


@dataclass(frozen=True)
class SavedState:
    tokens: list[int]  # the sequence the state holds
    outputs: Feeds  # as the runner returned them (batch of one): `logits` [1, 1, vocab] and the state outputs


def _key(t: dict[str, Any]) -> str:
    return "length" if t["kind"] == "length" else f"layer.{t['layer']}.{t['kind']}"


def _per_sequence(t: dict[str, Any], x: Tensor) -> Tensor:
    return x if t["kind"] == "length" else x[0]  # the static cache's length is one scalar for the batch


def save_state(path: Path, contract: dict[str, Any], config_hash: str, outputs: Feeds, tokens: list[int],
               shard: Shard = Shard(), *, origin: str) -> None:
    """Write the state of a batch of one (`outputs` of the step that consumed `tokens`) to `path`, renamed into
    place once complete."""
    from safetensors.torch import save

    tensors = {_key(t): _per_sequence(t, outputs[t["output"]]).detach().cpu().contiguous() for t in contract["tensors"]}
    tensors["tokens"] = torch.tensor(tokens, dtype=torch.int64)
    tensors["logits"] = outputs["logits"][0, -1].detach().float().cpu().contiguous()
    meta = {"format": FORMAT, "version": VERSION, "config_hash": config_hash, "weights": origin,
            "contract": json.dumps(contract), **shard.meta()}
    try:  # the one rule for a file the user named (fileio.write_output)
        write_output(Path(path), save(tensors, metadata=meta), flag="--save-state")
    except OutputError as e:
        raise StateFileError(str(e)) from None


def largest_state(contract: dict[str, Any], context: int, vocab_size: int) -> int:
    """The most bytes a state file of this contract can take: every tensor at `context` positions, the tokens,
    the logits and the header."""
    total = _HEADER_ROOM + 2 * len(json.dumps(contract)) + 8 * context + 4 * vocab_size
    for t in contract["tensors"]:
        n = torch_dtype(t["dtype"]).itemsize
        for d in t["shape"]:
            n *= context if d == "position" else int(d)
        total += n
    return total


def _file_bytes(path: Path, limit: int) -> bytes:
    """The bytes of `path`, opened once without blocking and read only when it is a regular file of at most
    `limit` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise StateFileError(f"{path}: cannot open it ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StateFileError(f"{path}: not a regular file (a state file is one); refused")
        if st.st_size > limit:
            raise StateFileError(f"{path}: {st.st_size} bytes, more than a state of this export's context can "
                                 f"take ({limit} bytes); refused")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise StateFileError(f"{path}: cannot read it ({e.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise StateFileError(f"{path}: grew past {limit} bytes while it was read; refused")
    return data


def _read(path: Path, limit: int) -> tuple[dict[str, Tensor], dict[str, str]]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    data = _file_bytes(path, limit)
    try:
        tensors = load(data)  # the header checked by safetensors: its metadata is then read from it
        (n,) = struct.unpack_from("<Q", data)
        meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise ValueError("its metadata is not a string map")
        return tensors, meta
    except (SafetensorError, ValueError, struct.error, AttributeError, RecursionError) as e:
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
               shard: Shard = Shard(), *, origin: str, context: int) -> SavedState:
    """The state in `path`, checked against the loading program's `shard`, `contract`, config hash, weights
    (`origin`, `weights_origin`) and `context` (the most positions a sequence may hold), as the outputs a
    runner would have returned (batch of one)."""
    tensors, meta = _read(Path(path), largest_state(contract, context, vocab_size))
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise StateFileError(f"{path}: not a k3x state file (format {str(meta.get('format'))[:40]!r}, version "
                             f"{str(meta.get('version'))[:10]!r}; this k3x reads {FORMAT!r} {VERSION})")
    theirs = {k: str(meta.get(k, v)) for k, v in Shard().meta().items()}
    if theirs != shard.meta():
        raise StateFileError(f"{path}: saved by {shard.describe(theirs)}, loaded by {shard.describe(shard.meta())}")
    if meta.get("config_hash") != config_hash:
        raise StateFileError(f"{path}: saved by an export of another model (config_hash "
                             f"{str(meta.get('config_hash'))[:16]}, this export's {config_hash[:16]})")
    if meta.get("weights") != origin:
        raise StateFileError(f"{path}: saved by an export of other weights ({str(meta.get('weights'))[:48]}, this "
                             f"export's {origin}); refused")
    problem = _contract_problem(meta.get("contract"), contract)
    if problem:
        raise StateFileError(f"{path}: {problem}")
    tokens, logits = tensors.get("tokens"), tensors.get("logits")
    if tokens is None or tokens.dtype != torch.int64 or tokens.dim() != 1 or not tokens.numel() \
            or int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise StateFileError(f"{path}: tokens: need int64 [T], T >= 1, ids in [0, {vocab_size})")
    if tokens.numel() > context:
        raise StateFileError(f"{path}: tokens: {tokens.numel()} positions, over the model's context ({context})")
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
    for name, x in [("logits", logits)] + [(_key(t), tensors[_key(t)]) for t in contract["tensors"]]:
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            raise StateFileError(f"{path}: {name}: holds NaN or inf; refused")
    return SavedState(tokens.tolist(), outputs)


def state_hooks(save: Path | None, load: Path | None, contract: dict[str, Any], cfg, prompt: list[int],
                shard: Shard = Shard(), *, origin: str) -> tuple[list[int], dict[str, Any]]:
    """(the sequence to decode, runners.generate's `start` / `on_prefill`) of `k3x run --save-state / --load-state`:
    decode from the state in `load` (its tokens replace `prompt`), and/or write the state after the prefill
    to `save` (rank programs: this rank's files of them, `shard_path`). `origin`: the export's
    `weights_origin`."""
    hooks: dict[str, Any] = {}
    if load is not None:
        saved = load_state(shard_path(load, shard), contract, cfg.hash(), cfg.vocab_size, shard, origin=origin,
                           context=cfg.max_position_embeddings)
        prompt, hooks["start"] = saved.tokens, saved.outputs
    if save is not None:
        tokens, file = list(prompt), shard_path(save, shard)
        try:  # before any runner loads
            check_output(file, flag="--save-state")
        except OutputError as e:
            raise StateFileError(str(e)) from None
        hooks["on_prefill"] = lambda outputs: save_state(file, contract, cfg.hash(), outputs, tokens, shard,
                                                         origin=origin)
    return prompt, hooks


def serving_hooks(save: Path | None, load: Path | None, contract: dict[str, Any], cfg, prompt: list[int],
                  shard: Shard = Shard(), *, origin: str) -> tuple[list[int], dict[str, Any]]:
    """`state_hooks` for a serving export: (the prompt, runtime/serve.serve's `resume` / `on_prefill` for
    prompt 0). The file is the same (per-sequence tensors named by the contract): the slot's KDA rows and the
    sequence's latent rows map to the contract's `input` pool names."""
    from .serve import SlotState

    prompt, hooks = state_hooks(save, load, contract, cfg, prompt, shard, origin=origin)
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
