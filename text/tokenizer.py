"""Text in and out: the tokenizer a checkpoint or export folder carries, EOS ids, chat template, streaming.

    tok = find_tokenizer(folder)            # None when the folder has no tokenizer
    ids = tok.encode("hello")               # list[int]
    stream = tok.stream(); stream.push(7)   # -> the text these ids add, once it is whole UTF-8

Notable choices:
- Formats: a Hugging Face `tokenizer.json` (the `tokenizers` library), or Kimi's tiktoken model
  (`tiktoken.model`: one `base64(bytes) rank` line per token) whose special tokens come from
  `tokenizer_config.json`'s `added_tokens_decoder` (needs the `tiktoken` package).
- EOS ids, first found: `generation_config.json`, `config.json` (or its `text_config`), the tokenizer
  config's `eos_token`. Both `k3x generate/run` and the GenAI config read them from here.
- The chat template is `chat_template.jinja` or `tokenizer_config.json`'s `chat_template` (a string, or
  the `default` entry of a list), rendered in a sandboxed Jinja environment as transformers does, bounded in
  time, memory, loop count and output (text/chat_template.py), with
  `add_generation_prompt=True`; the rendered text already holds its special tokens, so it is encoded
  without adding more.
- Streaming decodes all ids so far and emits the new suffix, holding back an incomplete UTF-8
  sequence (byte-level BPE splits characters across tokens).
- Every file is strict UTF-8; token ids (EOS, tiktoken ranks, added tokens) are JSON integers in
  [0, 2**32), ranks and added-token ids distinct (tiktoken panics otherwise): one TokenizerError line.
- `TOKENIZER_FILES` are what an export copies beside its models.
- An id the tokenizer has no token for (a vocabulary wider than the tokenizer, as padded vocabularies are;
  random weights emit such ids) decodes to the placeholder `<unk:ID>` (UNKNOWN), so text never ends a run
  whose tokens were computed; the ids themselves are printed and written as always.
- Every file is read through `_file`: it must resolve directly inside the folder (fileio.confined: a
  `chat_template.jinja` symlinked to a private file elsewhere is refused), and in an export folder
  (`listed`: the names of the manifest's hash-checked `tokenizer` files) it must be one the manifest lists.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Protocol

from ..fileio import confined

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tiktoken.model",
                   "chat_template.jinja", "generation_config.json")
# Kimi's tiktoken pre-tokenizer (tokenization_kimi.py in the Kimi model repositories): Han runs, words with
# case-aware affixes, digit groups of up to 3, punctuation, whitespace
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


class TokenizerError(ValueError):
    """A tokenizer file cannot be read or used; the message names the file."""


UNKNOWN = "<unk:{}>"  # the text of an id the tokenizer has no token for


class _Backend(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int], skip_special: bool = False) -> str: ...
    def token_id(self, token: str) -> int | None: ...
    def knows(self, token: int) -> bool: ...


def _file(folder: Path, name: str, listed: Collection[str] | None) -> Path | None:
    """`folder / name` when it is there, None when it is not; a TokenizerError when it resolves outside
    `folder` or (in an export: `listed` given) the manifest does not list it."""
    p = folder / name
    if not os.path.lexists(p):
        return None
    if listed is not None and name not in listed:
        raise TokenizerError(f"{p}: not a file the export's manifest lists; refused")
    p = confined(folder, name, error=TokenizerError, what="folder")
    return p if p.is_file() else None


def _read_text(path: Path) -> str:
    """A tokenizer-side text file as UTF-8 (one TokenizerError line naming it otherwise)."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise TokenizerError(f"{path}: unreadable ({e.strerror})") from None


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(_read_text(path))
    except (json.JSONDecodeError, RecursionError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _token_id(value: Any, where: str) -> int:
    """A token id as a JSON integer in [0, 2**32) (no floats, strings or booleans)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 32:
        text = repr(value)
        raise TokenizerError(f"{where}: {text[:80]}: a token id must be an integer in [0, 2**32)")
    return value


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict (else None)."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


class _HfTokenizer:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the library raises its own exception type
            raise TokenizerError(f"{path}: not a readable tokenizer.json ({e})") from None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def knows(self, token: int) -> bool:
        return self.tok.id_to_token(token) is not None


class _TiktokenTokenizer:
    def __init__(self, path: Path, config: dict[str, Any]) -> None:
        try:
            import tiktoken
        except ImportError:
            raise TokenizerError(f"{path}: reading a tiktoken model needs the tiktoken package "
                                 "(pip install tiktoken)") from None
        ranks = _tiktoken_ranks(path)
        special = _added_tokens(config, path.with_name("tokenizer_config.json"), set(ranks.values()))
        self.special = set(special.values())
        self.known = set(ranks.values()) | self.special
        self.enc = tiktoken.Encoding(name=path.parent.name, pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                     special_tokens=special)

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.enc.decode([i for i in ids if not (skip_special and i in self.special)])

    def token_id(self, token: str) -> int | None:
        try:
            return self.enc.encode_single_token(token)
        except KeyError:
            return None

    def knows(self, token: int) -> bool:
        return token in self.known


def _tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """`base64(bytes) rank` per line; ranks distinct integers in [0, 2**32) (tiktoken panics otherwise)."""
    import base64
    import binascii

    ranks: dict[bytes, int] = {}
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if line.strip():
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = _token_id(int(rank), f"{path}: line {n}")
            except TokenizerError:
                raise
            except (ValueError, binascii.Error):
                raise TokenizerError(f"{path}: line {n} is not 'base64-token rank'") from None
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: {len(missing)} of the 256 single bytes have no rank (first: {missing[0]}); "
                             "a byte-level BPE needs every byte")
    if len(set(ranks.values())) != len(ranks):
        raise TokenizerError(f"{path}: a rank is given to two tokens")
    return ranks


def _added_tokens(config: dict[str, Any], where: Path, ranks: set[int]) -> dict[str, int]:
    """tokenizer_config.json's `added_tokens_decoder` ({"id": {"content": ...}}) as special tokens."""
    added = config.get("added_tokens_decoder") or {}
    if not isinstance(added, dict):
        raise TokenizerError(f"{where}: added_tokens_decoder must be an object of id -> token")
    special = {}
    for key, value in added.items():
        tid = _token_id(int(key) if key.isdecimal() else key, f"{where}: added_tokens_decoder")
        if not isinstance(value, dict) or _token_text(value) is None:
            raise TokenizerError(f"{where}: added_tokens_decoder[{key!r}] has no \"content\" string")
        if tid not in ranks:
            special[_token_text(value)] = tid
    if len(set(special.values())) != len(special):
        raise TokenizerError(f"{where}: added_tokens_decoder gives two tokens one id")
    return special


@dataclass
class TextStream:
    """Incremental decoding for people: `push(id)` returns the text the new id completes (maybe ""). Special
    tokens (`<|eos|>`, `<|assistant|>`, ...) are not text and are left out; a UTF-8 sequence split across
    tokens is held back until it completes, and one still incomplete when decoding stops is dropped by
    `flush` (never printed as U+FFFD)."""

    tokenizer: Tokenizer
    ids: list[int] = field(default_factory=list)
    emitted: int = 0

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids, skip_special=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        new, self.emitted = text[self.emitted:], len(text)
        return new

    def flush(self) -> str:
        """Whatever is still held back, less an incomplete UTF-8 sequence at the very end (the decode stopped
        inside a character: there is no character to show)."""
        text = self.tokenizer.decode(self.ids, skip_special=True).rstrip("\ufffd")
        new, self.emitted = text[self.emitted:], max(len(text), self.emitted)
        return new


@dataclass
class Tokenizer:
    folder: Path
    backend: _Backend
    config: dict[str, Any]  # tokenizer_config.json ({} when absent)
    eos_token_ids: tuple[int, ...]
    chat_template: str | None

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text)

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        """The text of `ids`; `skip_special`: without special tokens (what a person reads). An id the
        tokenizer has no token for is `<unk:ID>` (UNKNOWN); the runs of known ids between are decoded whole."""
        ids = [int(i) for i in ids]
        if all(self.backend.knows(i) for i in ids):
            return self.backend.decode(ids, skip_special)
        text, run = [], []
        for i in ids + [None]:
            if i is not None and self.backend.knows(i):
                run.append(i)
                continue
            text.append(self.backend.decode(run, skip_special) if run else "")
            text.append("" if i is None else UNKNOWN.format(i))
            run = []
        return "".join(text)

    def stream(self) -> TextStream:
        return TextStream(self)

    def special_token(self, name: str) -> str | None:
        return _token_text(self.config.get(name))

    def chat_prompt(self, user_text: str) -> str:
        """The chat template rendered for one user message, ending where the assistant's reply starts."""
        return self.chat_messages([{"role": "user", "content": user_text}])

    def chat_messages(self, messages: list[dict[str, str]]) -> str:
        """The chat template rendered for `messages` ({"role", "content"}), ending where the assistant's reply
        starts."""
        if not self.chat_template:
            raise TokenizerError(f"{self.folder}: --chat needs a chat template (chat_template.jinja or "
                                 "tokenizer_config.json's chat_template); none found")
        from .chat_template import ChatTemplateError, render_chat_template

        variables = {"messages": messages, "add_generation_prompt": True,
                     "bos_token": self.special_token("bos_token") or "",
                     "eos_token": self.special_token("eos_token") or ""}
        try:
            return render_chat_template(self.chat_template, variables, str(self.folder))
        except ChatTemplateError as e:
            raise TokenizerError(str(e)) from None


def _chat_template(folder: Path, config: dict[str, Any], listed: Collection[str] | None) -> str | None:
    path = _file(folder, "chat_template.jinja", listed)
    if path is not None:
        return _read_text(path)
    t = config.get("chat_template")
    if isinstance(t, list):  # [{"name": ..., "template": ...}]
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) else None


def _ids(value: Any, where: str) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(_token_id(v, where) for v in (value if isinstance(value, list) else [value]))


def eos_token_ids(folder: Path, backend: _Backend | None = None, config: dict[str, Any] | None = None,
                  listed: Collection[str] | None = None) -> tuple[int, ...]:
    """EOS ids of a checkpoint / export folder: generation_config.json, config.json, then the tokenizer's.
    `listed`: in an export, the tokenizer files its manifest lists (hash-checked); others are refused."""
    folder = Path(folder)
    for name in ("generation_config.json", "config.json"):
        path = _file(folder, name, listed)
        if path is not None:
            data = read_json(path)
            text = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
            ids = _ids(data.get("eos_token_id", text.get("eos_token_id")), f"{path}: eos_token_id")
            if ids:
                return ids
    token = _token_text((config or {}).get("eos_token"))
    if backend is not None and token:
        tid = backend.token_id(token)
        return () if tid is None else (tid,)
    return ()


def find_tokenizer(folder: str | Path, listed: Collection[str] | None = None) -> Tokenizer | None:
    """The tokenizer in `folder`, or None when it has neither tokenizer.json nor tiktoken.model.
    `listed`: in an export, the tokenizer files its manifest lists (hash-checked); others are refused."""
    folder = Path(folder)
    config_path = _file(folder, "tokenizer_config.json", listed)
    config = read_json(config_path) if config_path is not None else {}
    if (hf := _file(folder, "tokenizer.json", listed)) is not None:
        backend: _Backend = _HfTokenizer(hf)
    elif (tik := _file(folder, "tiktoken.model", listed)) is not None:
        backend = _TiktokenTokenizer(tik, config)
    else:
        return None
    return Tokenizer(folder, backend, config, eos_token_ids(folder, backend, config, listed),
                     _chat_template(folder, config, listed))
