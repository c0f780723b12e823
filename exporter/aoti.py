"""Stage: AOTInductor package (`torch._inductor.aoti_compile_and_package`) from the traced program.

Notable choices:
- An AOTI package is TRUSTED CODE: it holds a compiled shared library that loading dlopens and runs.
  The runners load one only after its sha256 matches the export's manifest (folder/trust.py) — a
  package is exactly as trustworthy as the folder it came from; never load one from an untrusted source.
- The package embeds the weights, so it needs a program traced with real weights (not `--no-weights`).
- k3's ops are Python `torch.library.custom_op`s: AOTInductor compiles calls to them, and the package
  runs only in a Python process where they are registered — import k3x (or use `load_aoti`) before
  `torch._inductor.aoti_load_package`. A process without k3x fails with "Custom operators created via
  torch.library.custom_op cannot be run via AOTI without Python environment".
  `REQUIRES` says so in the manifest and the CLI output.
- Compiles for the device of the program's weights (CPU in CI; needs a C++ compiler).
- `load_aoti` copies the outputs: a package's outputs can share memory that its next call reuses
  (seen on CPU: feeding `present` from a prefill into the decode call read overwritten state).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch.export import ExportedProgram

PACKAGE = "model.aoti.pt2"
REQUIRES = "a Python process with k3x imported (k3 custom ops are Python custom_ops; see exporter/aoti.py)"


def compile_aoti(ep: ExportedProgram, package_path: str | Path,
                 inductor_configs: dict[str, Any] | None = None) -> Path:
    """Compile `ep` into an AOTInductor package at `package_path` (must end in `.pt2`)."""
    devices = {t.device.type for t in ep.state_dict.values()}
    if "meta" in devices:
        raise ValueError("aoti: the program was traced on the meta device (no weights); "
                         "AOTInductor packages embed weights — trace with weights")
    return Path(torch._inductor.aoti_compile_and_package(ep, package_path=str(package_path),
                                                         inductor_configs=inductor_configs))


def load_aoti(package_path: str | Path) -> Callable:
    """Load a package in this process (registering torch.ops.k3.* first); call it like the traced module:
    `runner(input_ids, past) -> (logits, present)`, or for a serving step (`--serving`)
    `runner(input_ids, cu_seqlens, past_lens, slots, block_table, logits_index, pools) -> (logits, new)`;
    outputs owned by the caller."""
    from .. import custom_ops  # noqa: F401  (the package calls torch.ops.k3.* through Python)

    package = torch._inductor.aoti_load_package(str(package_path))

    def run(*args) -> tuple[torch.Tensor, list[torch.Tensor]]:
        logits, present = package(*args)
        # the package reuses its output buffers on the next call: without these copies the state fed back
        # as `past.*` is overwritten while it is read (measured: decode steps wrong)
        return logits.clone(), [t.clone() for t in present]

    return run
