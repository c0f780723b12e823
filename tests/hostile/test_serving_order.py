"""A serving export's `serving.inputs` / `outputs` (manifest.json) are checked against the step program's own
order (runtime/runners.serving_entry): the pt2 and aoti runners feed the pools by position, so two pools
swapped in the manifest fed layer 0 with layer 1's state (wrong tokens, exit 0). Refused in one line."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
from hostile_util import edit_manifest, k3x

from k3x.runtime import runners
from k3x.runtime.base import RunnerError
from k3x.runtime.serve import serving_runner


@pytest.fixture()
def serving_copy(serving_export, tmp_path):
    out = tmp_path / "serving"
    shutil.copytree(serving_export, out)
    return out


def _swap(key: str, a: str, b: str):
    def change(m):
        names = m["serving"][key]
        i, j = names.index(a), names.index(b)
        names[i], names[j] = names[j], names[i]
    return change


@pytest.mark.parametrize("key,a,b", [("inputs", "pool.0.conv", "pool.1.conv"),
                                     ("inputs", "pool.0.recurrent", "pool.3.recurrent"),
                                     ("outputs", "new.2.latent", "new.4.latent")])
def test_pools_swapped_in_the_manifest_are_refused(serving_copy, key, a, b):
    edit_manifest(serving_copy, _swap(key, a, b))
    code, out = k3x("run", serving_copy, "--backend", "pt2", "--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "3")
    assert code == 1 and out.strip().count("\n") == 0 and "Traceback" not in out, out
    assert f"is {b!r}, the step program's {key[:-1]} " in out and f"is {a!r} (its own order" in out, out


def test_a_pool_missing_from_the_manifest_is_refused(serving_copy):
    edit_manifest(serving_copy, lambda m: m["serving"]["inputs"].pop())
    code, out = k3x("run", serving_copy, "--backend", "pt2", "--prompt-ids", "3,1,4", "--max-new-tokens", "2")
    assert code == 1 and out.strip().count("\n") == 0 and "serving.inputs[14] is missing" in out, out


def test_a_program_taking_other_inputs_than_the_manifest_lists_is_refused(serving_export, monkeypatch):
    """The pt2 program's own signature (its graph's user inputs) must take as many inputs as the manifest lists."""
    short = SimpleNamespace(graph_signature=SimpleNamespace(user_inputs=["input_ids", "cu_seqlens", "pools_0"]))
    monkeypatch.setattr(runners, "load_pt2_artifact", lambda *a, **k: short)
    with pytest.raises(RunnerError, match=r"the step program takes 3 inputs \(input_ids, cu_seqlens, pools_0\), "
                                          r"the manifest's serving.inputs lists 15; refused"):
        serving_runner("pt2", serving_export)
