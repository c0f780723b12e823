"""The other implementation's rows for bench/cpu_decode.py: llama.cpp on the same weights, against the same floor.

llama.cpp has its own K3 model (`kimi-k3`, its converter reading the MXFP4 experts of K3's published layout); given
a built checkout (`--llama-cpp DIR`: DIR holds `convert_hf_to_gguf.py`, `gguf-py/` and `build/bin/llama-bench`) and
a preset in K3's layout, the bench writes the preset's seed-0 weights as a Hugging Face checkpoint
(checkpoint/save.py, MXFP4 experts packed), converts it with llama.cpp's own converter once per trunk (its
`--outtype`: f32, bf16, q8_0; the MXFP4 experts stay MXFP4 in every file) and runs `llama-bench` on each, right
after k3x's form of the same trunk in each round:
  - prefill: `-p P -n 0` (a P-token prompt from an empty context) -> tokens/s
  - decode: `-p 0 -n STEPS -d P` (STEPS one-token steps after a P-token context) -> ms/token
  - floor: the step bytes of that file (every tensor but `token_embd`, top_k / num_experts of each `*_exps`
    tensor, in the file's own block formats: Q8_0 is 34 bytes per 32 weights, k3x's int8 36 per 32) at the
    rate k3x's floor reads of the same round ran at; `floor_share` = median floor / median decode (llama-bench
    gives one figure per run, not per step).
Before the rows, a parity check (`parity`): the same weights with the experts decoded to fp32, converted with
`--outtype f32`, run by bench/llama_cpp_logits.cc (compiled against the checkout's llama.h and libllama; an fp32
cache, no flash attention) on a 16-token prompt and 4 one-token steps, against k3x's eager model's logits for the
same 20 ids (one forward: runtime/generate.py's full_logits): the bench stops unless every logit is within
PARITY_TOL. llama-bench's rows then run llama.cpp as its users do: an f16 cache, flash attention where it has it,
and its MXFP4 expert GEMMs on activations quantised to 8 bits per block of 32 (Q8_0), where k3x's kernel keeps
them fp32.
A checkpoint written by k3x carries no tokenizer; the converter gets a placeholder vocabulary of the config's
size (`<t0>`, `<t1>`, ...), which llama-bench (random token ids, no text) never reads.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# k3x form -> llama.cpp's converter --outtype for the same trunk (the experts are MXFP4 in both)
OUTTYPES = {"mxfp4": "f32", "mxfp4+bf16": "bf16", "mxfp4+int8": "q8_0"}
# k3x's logits against llama.cpp's on the parity check's fp32 weights (k3-bench: 2.04e-5 at most)
PARITY_TOL = 1e-4
PARITY_PROMPT, PARITY_STEPS = 16, 4

# run in a child python: llama.cpp's converter with a placeholder vocabulary (argv: DIR, then the converter's)
_CONVERT = r'''
import runpy, sys
L = sys.argv.pop(1)
sys.path[:0] = [L, L + "/gguf-py"]
import gguf
from conversion.kimi_k3 import KimiK3Model

def set_vocab(self):
    n = self.hparams.get("vocab_size") or self.hparams["text_config"]["vocab_size"]
    w = self.gguf_writer
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"<t{i}>".encode() for i in range(n)])
    w.add_token_scores([0.0] * n)
    w.add_token_types([gguf.TokenType.NORMAL] * n)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

KimiK3Model.set_vocab = set_vocab
sys.argv[0] = L + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
'''


class LlamaCpp:
    """A built llama.cpp checkout: its converter, its GGUF reader and its llama-bench, for `cfg`'s weights."""

    def __init__(self, root: Path, cfg):
        from k3x.checkpoint.published import is_k3

        if not is_k3(cfg):
            raise SystemExit(f"--llama-cpp: {cfg.name} is in Kimi Linear's layout; the rows beside llama.cpp are for "
                             "presets in K3's (k3-bench, k3-mini, k3), whose MXFP4 experts its K3 converter reads")
        self.root = root.resolve()
        self.bench = self.root / "build" / "bin" / "llama-bench"
        for need in (self.root / "convert_hf_to_gguf.py", self.root / "gguf-py", self.bench):
            if not need.exists():
                raise SystemExit(f"--llama-cpp {root}: no {need.relative_to(self.root)} (a built llama.cpp "
                                 "checkout: cmake -B build && cmake --build build --target llama-bench)")

    def convert(self, checkpoint: Path, outtype: str, out: Path) -> Path:
        r = subprocess.run([sys.executable, "-c", _CONVERT, str(self.root), str(checkpoint), "--outtype", outtype,
                            "--outfile", str(out)], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"llama.cpp's converter failed on {checkpoint} (--outtype {outtype}):\n"
                             f"{r.stderr.strip()[-3000:]}")
        return out

    def tensors(self, gguf_file: Path) -> list[tuple[str, int]]:
        """(name, bytes) of every tensor in `gguf_file`, read by llama.cpp's own gguf-py."""
        sys.path.insert(0, str(self.root / "gguf-py"))
        try:
            import gguf
        finally:
            sys.path.pop(0)
        return [(t.name, int(t.n_bytes)) for t in gguf.GGUFReader(gguf_file).tensors]

    def logits_probe(self, out: Path) -> Path:
        """bench/llama_cpp_logits.cc compiled against this checkout (its llama.h, ggml.h and libllama)."""
        libs = sorted(self.root.glob("build/**/libllama.so"))
        if not libs:
            raise SystemExit(f"--llama-cpp {self.root}: no libllama.so under build/ (a shared-library build)")
        cxx = os.environ.get("CXX", "g++")
        r = subprocess.run([cxx, "-O2", "-std=c++17", str(Path(__file__).with_name("llama_cpp_logits.cc")),
                            f"-I{self.root / 'include'}", f"-I{self.root / 'ggml' / 'include'}",
                            f"-L{libs[0].parent}", "-lllama", f"-Wl,-rpath,{libs[0].parent}", "-o", str(out)],
                           capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{cxx} failed on bench/llama_cpp_logits.cc against {self.root}:\n{r.stderr[-3000:]}")
        return out

    def run(self, gguf_file: Path, args: list[str], threads: int) -> list[dict]:
        """llama-bench's JSON records. Its OpenMP threads wait as they do by default: the PASSIVE policy this
        process runs under (for torch's threads) made its decode 3-4x slower."""
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        r = subprocess.run([str(self.bench), "-m", str(gguf_file), "-t", str(threads), "-r", "1", "-o", "json",
                            *args], capture_output=True, text=True, env=env)
        if r.returncode:
            raise SystemExit(f"llama-bench failed on {gguf_file}:\n{r.stderr.strip()[-3000:]}")
        return json.loads(r.stdout)


def gguf_step_bytes(tensors: list[tuple[str, int]], top_k: int, num_experts: int) -> int:
    """The bytes a decode step reads from a GGUF's tensors: all but the embedding table (`token_embd.*`), and
    top_k / num_experts of each routed experts' tensor (`*_exps.*`: every expert of a layer in one tensor)."""
    total = 0
    for name, n in tensors:
        if name.startswith("token_embd."):
            continue
        total += n * top_k // num_experts if "_exps." in name else n
    return total


def figures(prefill: list[dict], decode: list[dict]) -> dict[int, dict[str, list[float]]]:
    """llama-bench's JSON records -> per depth P: prefill_s (seconds for the P-token prompt) and decode_s
    (seconds per token), one value per repetition, as bench/cpu_decode.py's children give them."""
    out: dict[int, dict[str, list[float]]] = {}
    for r in prefill:
        if r["n_gen"] or r["n_depth"]:
            raise ValueError(f"not a prefill record: n_gen {r['n_gen']}, n_depth {r['n_depth']}")
        out.setdefault(r["n_prompt"], {}).setdefault("prefill_s", []).extend(
            r["n_prompt"] / ts for ts in r["samples_ts"])
    for r in decode:
        if r["n_prompt"] or not r["n_gen"]:
            raise ValueError(f"not a decode record: n_prompt {r['n_prompt']}, n_gen {r['n_gen']}")
        out.setdefault(r["n_depth"], {}).setdefault("decode_s", []).extend(1 / ts for ts in r["samples_ts"])
    return out


def measure_file(lc: LlamaCpp, gguf_file: Path, depths: list[int], steps: int, threads: int
                 ) -> tuple[dict[int, dict[str, list[float]]], str]:
    """One round of one file: llama-bench's prefill and decode at each depth (per depth the lists `figures`
    gives) and llama.cpp's build (its commit)."""
    ps = ",".join(map(str, depths))
    pre = lc.run(gguf_file, ["-p", ps, "-n", "0", "-d", "0"], threads)
    dec = lc.run(gguf_file, ["-p", "0", "-n", str(steps), "-d", ps], threads)
    return figures(pre, dec), pre[0].get("build_commit", "?")


def summary(raw: dict[int, dict[str, list[float]]], depths: list[int]) -> dict[int, dict[str, float]]:
    """Medians over the rounds: prefill tok/s, decode ms/token, floor ms, floor share (floor / decode)."""
    out = {}
    for P in depths:
        r = raw[P]
        ms, fl = 1e3 * statistics.median(r["decode_s"]), statistics.median(r["floor_ms"])
        out[P] = {"prefill_tokens_per_s": P / statistics.median(r["prefill_s"]), "decode_ms_per_token": ms,
                  "floor_ms": fl, "floor_share": fl / ms}
    return out


def print_rows(rows: dict[str, dict]) -> None:
    build = next(iter(rows.values()))["build"]
    print(f"llama.cpp (build {build}) on the same weights: its converter's --outtype, MXFP4 experts, llama-bench "
          "right after each form in each round; floor: its bytes at the rate of that form's reads")
    print(f"{'form':<10} {'outtype':>7} {'depth':>6} {'prefill tok/s':>14} {'decode ms/tok':>14} {'step MB':>8} "
          f"{'floor ms':>9} {'floor share':>12}")
    for form, row in rows.items():
        for P, f in row["depths"].items():
            print(f"{form:<10} {row['outtype']:>7} {P:>6} {f['prefill_tokens_per_s']:>14.1f} "
                  f"{f['decode_ms_per_token']:>14.2f} {row['step_bytes'] / 1e6:>8.1f} {f['floor_ms']:>9.2f} "
                  f"{f['floor_share']:>12.2f}")


def parity(lc: LlamaCpp, packed_model, dense_model, cfg, tmp: Path, threads: int) -> dict:
    """llama.cpp's logits against k3x's on the same fp32 weights (module docstring): `dense_model` (the packed
    model's weights, its experts decoded: bench/cpu_decode.py's same_weights) is what llama.cpp gets, k3x's logits
    are `packed_model`'s. {"max_abs", "positions", "tolerance"}, or SystemExit naming the worst position when a
    logit is further than PARITY_TOL."""
    import numpy as np
    import torch

    from k3x.checkpoint.save import save_checkpoint
    from k3x.runtime.generate import full_logits

    checkpoint = save_checkpoint(dense_model, tmp / "parity-checkpoint", expert_format="dense")
    gguf_file = lc.convert(checkpoint, "f32", tmp / "parity-f32.gguf")
    n = PARITY_PROMPT + PARITY_STEPS
    ids = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
    r = subprocess.run([str(lc.logits_probe(tmp / "llama_cpp_logits")), str(gguf_file), str(threads),
                        str(PARITY_PROMPT)], input=ids.to(torch.int32).numpy().tobytes(), capture_output=True)
    if r.returncode:
        raise SystemExit(f"llama_cpp_logits failed:\n{r.stderr.decode(errors='replace')[-3000:]}")
    theirs = np.frombuffer(r.stdout, dtype=np.float32).reshape(n, -1)
    ours = full_logits(packed_model, ids)[0].numpy()  # causal: one forward gives every position's logits
    diff = np.abs(ours - theirs).max(axis=1)
    if not diff.max() <= PARITY_TOL:  # a NaN fails too
        raise SystemExit(f"llama.cpp's logits are not k3x's on the same fp32 weights: {diff.max():.3e} at position "
                         f"{int(diff.argmax())} of {n} (tolerance {PARITY_TOL:g}); its rows would not compare one "
                         "model")
    return {"max_abs": float(diff.max()), "positions": n, "tolerance": PARITY_TOL}


def prepare(lc: LlamaCpp, packed_model, forms: list[str], tmp: Path, top_k: int, num_experts: int
            ) -> dict[str, tuple[Path, int]]:
    """The checkpoint of `packed_model` (MXFP4 experts) converted once per form of `forms` that llama.cpp has:
    form -> (GGUF, its step bytes)."""
    from k3x.checkpoint.save import save_checkpoint

    checkpoint = save_checkpoint(packed_model, tmp / "checkpoint", expert_format="mxfp4")
    out = {}
    for form in forms:
        if form in OUTTYPES:
            g = lc.convert(checkpoint, OUTTYPES[form], tmp / f"{OUTTYPES[form]}.gguf")
            out[form] = (g, gguf_step_bytes(lc.tensors(g), top_k, num_experts))
    return out
