"""ONNX Runtime runner: provider choice, IO binding with state carried between steps, bad-input errors,
and `k3x run --backend ort` against eager greedy decoding."""

from __future__ import annotations

import sys

import pytest
import torch
from typer.testing import CliRunner

from k3x.checkpoint.files import load_checkpoint
from k3x.cli import app
from k3x.model import K3Config, empty_state, preset, state_specs
from k3x.model.state_contract import state_contract
from k3x.runtime import generate as eager
from k3x.runtime.ort_runner import OrtRunner, import_onnxruntime, known_dims, output_shapes
from k3x.runtime.runners import DecodeSteps, RunnerError, RunnerOptions, generate, make_runner, next_feeds
from k3x.text.sampling import SamplingOptions
from onnx_mini_folder import mini_export

ort = pytest.importorskip("onnxruntime")
CFG = preset("k3-mini")
cli = CliRunner()


def start_feeds(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": ids, **dict(zip((s.input_name for s in state_specs(CFG)), empty_state(CFG, ids.shape[0])))}


def test_auto_provider_is_what_the_session_really_uses():
    runner = make_runner("ort", mini_export().folder, RunnerOptions(provider="auto"))
    assert runner.provider == ("cuda" if "CUDAExecutionProvider" in runner.session.get_providers() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_provider_without_cuda_fails_clearly():
    with pytest.raises(RunnerError, match="CUDAExecutionProvider did not initialise"):
        make_runner("ort", mini_export().folder, RunnerOptions(provider="cuda"))


def test_output_shapes_from_dim_names():
    feeds = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "past_key_values.2.latent": torch.zeros(2, 7, 32)}
    known = known_dims(feeds)
    assert known == {"batch": 2, "seq": 5, "past_seq": 7, "total_seq": 12}
    shapes = output_shapes({"logits": ["batch", "seq", 512], "present.2.latent": ["batch", "total_seq", 32]}, known)
    assert shapes == {"logits": (2, 5, 512), "present.2.latent": (2, 12, 32)}
    with pytest.raises(RunnerError, match="unk"):
        output_shapes({"x": ["unk"]}, known)
    assert known_dims({"input_ids": torch.zeros(1, 3, dtype=torch.long)})["past_seq"] == 0  # no cache fed


def test_io_binding_decode_matches_eager_step_by_step():
    m = mini_export()
    runner = OrtRunner(m.folder / "model.onnx", provider="cpu")
    model = load_checkpoint(m.checkpoint)
    ids = torch.tensor([[5, 9, 2, 7], [1, 1, 3, 8]])
    feeds = start_feeds(ids)
    state = list(feeds.values())[1:]
    for step in range(4):
        out = runner.infer(feeds)
        with torch.no_grad():
            logits, state = model(feeds["input_ids"], state)
        torch.testing.assert_close(out["logits"], logits, atol=2e-5, rtol=2e-4)
        for s, t in zip(state_specs(CFG), state):
            torch.testing.assert_close(out[s.output_name], t, atol=2e-5, rtol=2e-4, msg=f"step {step} {s.output_name}")
        token = logits[:, -1].argmax(-1, keepdim=True)
        feeds = next_feeds(CFG, out, token)  # ORT's own present tensors become its next past
        assert feeds["past_key_values.2.latent"].shape[1] == ids.shape[1] + step


def bound_names(runner: OrtRunner) -> list[str]:
    """The names the runner binds from now on, in order (its `_bind` spied on)."""
    names, bind = [], runner._bind
    runner._bind = lambda binding, name, *a, **k: (names.append(name), bind(binding, name, *a, **k))[1]
    return names


def test_decode_steps_reuse_the_step_before_lasts_states_and_keep_their_bindings():
    """DecodeSteps writes step n's states into step n - 2's tensors (never the prefill's), the runner keeps the
    two bindings, and each step still equals the eager model's."""
    m = mini_export()
    runner = OrtRunner(m.folder / "model.onnx", provider="cpu")
    model = load_checkpoint(m.checkpoint)
    binds = bound_names(runner)
    ids = torch.tensor([[5, 9, 2, 7], [1, 1, 3, 8]])
    out = first = runner.infer(start_feeds(ids))
    prefill = {n: t.clone() for n, t in first.items()}
    state = [t.clone() for t in list(start_feeds(ids).values())[1:]]
    with torch.no_grad():
        _, state = model(ids, state)
    steps, fixed = DecodeSteps(runner, CFG), [s.output_name for s in state_specs(CFG) if "latent" not in s.output_name]
    latents = [s.output_name for s in state_specs(CFG) if "latent" in s.output_name]
    seen = []
    for step in range(6):
        token = out["logits"][:, -1].argmax(-1, keepdim=True)
        binds.clear()
        new = steps(out, token)
        with torch.no_grad():
            logits, state = model(token, state)
        torch.testing.assert_close(new["logits"], logits, atol=2e-5, rtol=2e-4)
        for s, t in zip(state_specs(CFG), state):
            torch.testing.assert_close(new[s.output_name], t, atol=2e-5, rtol=2e-4, msg=f"step {step} {s.output_name}")
        seen.append({n: new[n].data_ptr() for n in fixed})
        if step >= 2:  # the step before last's states, written over
            assert seen[-1] == seen[-3], step
        if step >= 3:  # both bindings kept: only the token, the growing latent caches and the logits bound again
            assert sorted(binds) == sorted(["input_ids", "logits", *latents, *(n.replace("present", "past_key_values")
                                                                                for n in latents)]), binds
        assert not any(n in steps._spare for n in latents)  # a growing cache is not held a step longer
        out = new
    for n, t in prefill.items():  # the prefill's outputs were never written over
        assert torch.equal(first[n], t), n


def test_a_fed_tensor_reshaped_in_place_is_bound_again():
    """The kept binding is checked against each tensor's address and shape, not only its identity: the same
    input_ids tensor shrunk in place (same address, a new shape) is a new prompt."""
    m = mini_export()
    runner = OrtRunner(m.folder / "model.onnx", provider="cpu")
    model = load_checkpoint(m.checkpoint)
    ids = torch.tensor([[5, 9, 2, 7]])
    feeds = start_feeds(ids)
    first = runner.infer(feeds)
    assert first["logits"].shape[1] == 4
    ptr = ids.data_ptr()
    ids.resize_(1, 3)
    assert ids.data_ptr() == ptr  # the same tensor at the same address
    again = {n: t for n, t in first.items() if "latent" not in n and n != "logits"}  # the first call's binding
    binds = bound_names(runner)
    got = runner.infer(feeds, out=again)["logits"]
    assert "input_ids" in binds and not any(n in binds for n in again), binds
    with torch.no_grad():
        want, _ = model(torch.tensor([[5, 9, 2]]), list(start_feeds(ids).values())[1:])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-4)


def test_feeds_that_do_not_match_the_model_are_named():
    runner = OrtRunner(mini_export().folder / "model.onnx", provider="cpu")
    feeds = start_feeds(torch.tensor([[1, 2]]))
    del feeds["past.0.conv"]
    with pytest.raises(RunnerError, match=r"missing \['past.0.conv'\]"):
        runner.infer(feeds)
    feeds = start_feeds(torch.tensor([[1, 2]]))
    feeds["past.1.recurrent"] = feeds["past.1.recurrent"].double()
    with pytest.raises(RunnerError, match="past.1.recurrent"):
        runner.infer(feeds)


def test_missing_onnxruntime_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(RunnerError, match="onnxruntime is not installed"):
        import_onnxruntime()


def test_greedy_decode_equals_eager_generate_and_cli_prints_it():
    m = mini_export()
    prompt = torch.tensor([[1, 2, 3]])
    six = SamplingOptions(max_new_tokens=6)
    expected = eager.generate(load_checkpoint(m.checkpoint), prompt, six).tokens
    tokens = generate(make_runner("ort", m.folder, RunnerOptions(provider="cpu")), CFG, prompt, six).tokens
    assert torch.equal(tokens, expected)
    res = cli.invoke(app, ["run", str(m.folder), "--backend", "ort", "--prompt-ids", "1,2,3", "--max-new-tokens", "6",
                           "--provider", "cpu"])
    assert res.exit_code == 0, res.output
    assert "tokens: " + ",".join(map(str, expected[0].tolist())) in res.output
    assert "backend ort on cpu" in res.output and "tokens/s" in res.output


def test_seeded_sampling_is_the_same_on_ort_and_eager():
    m = mini_export()
    opts = SamplingOptions(max_new_tokens=8, temperature=1.2, top_k=50, seed=9)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    expected = eager.generate(load_checkpoint(m.checkpoint), prompt, opts).tokens
    res = cli.invoke(app, ["run", str(m.folder), "--backend", "ort", "--prompt-ids", "3,1,4,1,5", "--max-new-tokens",
                           "8", "--temperature", "1.2", "--top-k", "50", "--seed", "9", "--provider", "cpu"])
    assert res.exit_code == 0, res.output
    assert "tokens: " + ",".join(map(str, expected[0].tolist())) in res.output


def test_run_rejects_a_folder_that_is_not_an_export(tmp_path):
    res = cli.invoke(app, ["run", str(tmp_path), "--backend", "ort"])
    assert res.exit_code == 1
    assert "no manifest (run `k3x export` into this folder first)" in res.output and str(tmp_path) in res.output


def test_a_model_whose_inputs_do_not_match_the_export_is_named(tmp_path):
    import json
    import shutil

    folder = shutil.copytree(mini_export().folder, tmp_path / "export")
    manifest = json.loads((folder / "manifest.json").read_text())
    cfg = manifest["config"]  # claim one layer fewer than model.onnx has: the state feeds no longer match
    cfg["layer_types"], cfg["mlp_types"] = cfg["layer_types"][:-1], cfg["mlp_types"][:-1]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    args = ["run", str(folder), "--backend", "ort", "--provider", "cpu", "--max-new-tokens", "2"]
    res = cli.invoke(app, args)  # the manifest's state contract no longer fits its config: refused on open
    assert res.exit_code == 1 and "the state contract must match the config" in res.output, res.output
    manifest["state"] = state_contract(K3Config.from_dict(cfg), torch.float32)  # consistent manifest, wrong model
    (folder / "manifest.json").write_text(json.dumps(manifest))
    res = cli.invoke(app, args)
    assert res.exit_code == 1
    assert "feeds do not match the model inputs" in res.output and "past_key_values.5.latent" in res.output


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_freed_heap_hands_freed_memory_back():
    """What a session load freed (ORT's constant folding copies weights) goes back to the OS: 256 MB freed in
    64 KB blocks (heap, not mmap) stays in RSS until `release_freed_heap`."""
    import ctypes

    from k3x.runtime.host_memory import release_freed_heap

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    blocks = [libc.malloc(64 * 1024) for _ in range(4096)]
    for b in blocks:
        ctypes.memset(b, 1, 64 * 1024)
    for b in blocks[:-1]:  # the last block pins the heap's top: plain free() cannot shrink it away
        libc.free(b)
    before = rss_mb()
    release_freed_heap()
    assert rss_mb() < before - 200, (before, rss_mb())
    libc.free(blocks[-1])
