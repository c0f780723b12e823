"""model/state_contract.py: the contract both interfaces record, from the one state description (model/state.py)."""

from __future__ import annotations

import torch

from k3x.folder.artifacts import ExportFolder, init_manifest
from k3x.model import preset
from k3x.model.options import CacheOptions
from k3x.model.serving import pool_names
from k3x.model.state import state_specs
from k3x.model.state_contract import contract_mismatch, state_contract

CFG = preset("k3-mini")


def test_batch_contract_follows_the_state_specs():
    c = state_contract(CFG, torch.bfloat16)
    assert c["interface"] == "batch" and c["latent_block_size"] is None
    specs = state_specs(CFG)
    assert [(t["layer"], t["input"], t["output"]) for t in c["tensors"]] == \
        [(s.layer, s.input_name, s.output_name) for s in specs]
    rec = next(t for t in c["tensors"] if t["kind"] == "kda_recurrent")
    assert rec["shape"] == [4, 16, 16] and rec["axes"] == ["head", "key", "value"] and rec["dtype"] == "fp32"
    assert {t["update"] for t in c["tensors"]} == {"replace"} and {t["snapshot"] for t in c["tensors"]} == {"token"}
    static = state_contract(CFG, torch.float32, cache=CacheOptions(24))
    assert static["tensors"][-1]["kind"] == "length" and static["tensors"][4]["shape"] == [24, 32]


def test_serving_contract_names_the_pools_and_block_size():
    c = state_contract(CFG, torch.bfloat16, block_size=8)
    assert c["interface"] == "serving" and c["latent_block_size"] == 8
    assert [(t["input"], t["output"]) for t in c["tensors"]] == pool_names(CFG)
    latent = next(t for t in c["tensors"] if t["kind"] == "mla_latent")
    assert latent == {"layer": 2, "kind": "mla_latent", "input": "pool.2.latent", "output": "new.2.latent",
                      "shape": ["position", 32], "axes": ["position", "latent"], "dtype": "bf16",
                      "update": "append", "snapshot": "block"}
    conv = c["tensors"][0]
    assert conv["update"] == "replace" and conv["snapshot"] == "token" and conv["shape"] == [192, 3]


def test_a_serving_manifest_records_and_checks_the_serving_contract(tmp_path):
    serving = {"block_size": 8, "inputs": [], "outputs": []}
    m = init_manifest(tmp_path, CFG, dtype=torch.float32, weights=False, op_counts={}, serving=serving)
    assert m["state"] == state_contract(CFG, torch.float32, block_size=8)
    assert ExportFolder.open(tmp_path).state_contract() == m["state"]
    assert contract_mismatch(m["state"], state_contract(CFG, torch.float32, block_size=16)) == \
        "state.latent_block_size=8, the config gives 16"
