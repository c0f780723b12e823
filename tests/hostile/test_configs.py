"""A malformed config.json is one short line naming the field (exit 1), checked before anything is built."""

from __future__ import annotations

import json
import time

import pytest
from hostile_util import k3x

from k3x.checkpoint.hf_config import config_to_hf
from k3x.model.config import ConfigError, K3Config, preset


def _write(ckpt, text: str | bytes) -> None:
    (ckpt / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())


def _hf(change) -> str:
    c = config_to_hf(preset("k3-mini"))
    change(c["text_config"])
    return json.dumps(c)


def _inspect(tmp_path):
    t = time.perf_counter()
    code, out = k3x("inspect", "--checkpoint", tmp_path)
    return code, out, time.perf_counter() - t


@pytest.mark.parametrize("text,field", [
    ("[]", "must hold a JSON object, not list"),
    ('"k3"', "must hold a JSON object, not str"),
    ("Infinity", "Infinity is not a valid JSON number"),
    (b"\xff\xfe{}", "not UTF-8"),
    ("[" * 5000 + "]" * 5000, "nested"),
    ('{"model_type": "kimi_linear", "a": ' + "[" * 40 + "]" * 40 + "}", "nested more than"),
    (_hf(lambda t: t.update(hidden_size="big")), "hidden_size='big': must be an int"),
    (_hf(lambda t: t.update(hidden_size=64.9)), "hidden_size=64.9: must be an int"),
    (_hf(lambda t: t.update(num_attention_heads=3.7)), "num_attention_heads=3.7"),
    (_hf(lambda t: t.update(routed_scaling_factor=float("nan"))), "NaN is not a valid JSON number"),
    (_hf(lambda t: t.update(max_position_embeddings=-1)), "max_position_embeddings=-1"),
    (_hf(lambda t: t.update(num_hidden_layers=10**6)), "num_hidden_layers=1000000: must be in 1..1024"),
    (_hf(lambda t: t.update(hidden_size=10**9)), "hidden_size=1000000000: must be <= 65536"),
    (_hf(lambda t: t.update(vocab_size=10**12)), "vocab_size=1000000000000"),
    (_hf(lambda t: t.update(num_experts=10**7)), "num_experts=10000000"),
    (_hf(lambda t: t.update(linear_attn_config=[])), "linear_attn_config=[]: must be a dict"),
    (_hf(lambda t: t["linear_attn_config"].update(kda_layers=["a"])), "kda_layers=['a']"),
    (_hf(lambda t: t.update(mla_use_output_gate="yes")), "mla_use_output_gate='yes': must be a bool"),
])
def test_malformed_config_is_one_line_naming_the_field(ckpt_dir, text, field):
    _write(ckpt_dir, text)
    code, out, seconds = _inspect(ckpt_dir)
    assert code == 1 and field in out and "Traceback" not in out, out
    assert len(out.splitlines()) == 1 and len(out) < 600 and seconds < 10, (len(out), seconds)


def test_huge_value_is_cut_in_the_message(ckpt_dir):
    _write(ckpt_dir, _hf(lambda t: t.update(model_name="x", hidden_size="x" * 10**7)))
    code, out, _ = _inspect(ckpt_dir)
    assert code == 1 and len(out) < 600, len(out)


def test_manifest_config_types_are_checked_too():
    d = preset("k3-mini").to_dict()
    d["kda"]["num_heads"] = True
    with pytest.raises(ConfigError, match="kda.num_heads=True: must be an integer"):
        K3Config.from_dict(d)
    d = preset("k3-mini").to_dict()
    d["situ_beta"] = float("inf")
    with pytest.raises(ConfigError, match="situ_beta=inf: must be a finite number"):
        K3Config.from_dict(d)
