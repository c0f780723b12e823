"""Build and run choices, kept apart from the architecture (`K3Config` is exactly what config.json says).

- `BuildOptions`: how the network is built: the k3 custom-op implementation (`kernels`, traced into a
  program), how routed experts are held (`expert_format`: dense floats or MXFP4-packed) and what the expert
  GEMMs are fed (`activations`: "bf16", the activations as computed, or "mxfp8", rounded through OCP MXFP8 —
  E4M3 with one E8M0 scale per 32 along K — as K3 was trained; MXFP4 experts only: W4A8) and how the dense
  projections are held (`trunk`: "dense", in the model dtype; "bf16" or "int8": fp32 activations on bf16 or
  8-bit block-quantised weights, the CPU trunks of model/trunk.py).
- `CacheOptions`: the MLA latent cache: growing (`max_context=None`) or static, preallocated to
  `max_context` positions (model/state.py).
- `ModelOptions`: both, as an export records them in its manifest's `options` entry. The parallel plan is
  `model/parallel.ParallelPlan` (the manifest's `parallel` entry).

An option never changes the architecture or its hash. Manifests written before the options had their own
entry kept them inside `config`; `ModelOptions.from_manifest` reads them from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..plan.kernels import Kernels
from .config import LEGACY_OPTION_KEYS, ConfigError, K3Config

ExpertFormat = Literal["dense", "mxfp4"]
Activations = Literal["bf16", "mxfp8"]  # custom_ops/moe_mxfp4/mxfp8.ACTIVATIONS
Trunk = Literal["dense", "bf16", "int8"]  # model/trunk.TRUNKS


@dataclass(frozen=True)
class BuildOptions:
    kernels: Kernels = Kernels.REFERENCE  # k3 custom-op implementation (not the runner)
    expert_format: ExpertFormat = "dense"  # routed experts dense or MXFP4-packed (k3::moe_mxfp4)
    activations: Activations = "bf16"  # expert-GEMM inputs as computed, or MXFP8 (needs MXFP4 experts)
    trunk: Trunk = "dense"  # dense projections in the model dtype, or bf16 / int8 weights (fp32 activations)

    def __post_init__(self) -> None:
        if not isinstance(self.kernels, Kernels):
            try:
                object.__setattr__(self, "kernels", Kernels(self.kernels))
            except ValueError:
                raise ConfigError(f"kernels={self.kernels!r}: must be one of "
                                  f"{[k.value for k in Kernels]}") from None
        if self.expert_format not in ("dense", "mxfp4"):
            raise ConfigError(f"expert_format={str(self.expert_format)[:80]!r}: must be 'dense' or 'mxfp4'")
        if self.activations not in ("bf16", "mxfp8"):
            raise ConfigError(f"activations={str(self.activations)[:80]!r}: must be 'bf16' or 'mxfp8'")
        if self.trunk not in ("dense", "bf16", "int8"):
            raise ConfigError(f"trunk={str(self.trunk)[:80]!r}: must be 'dense', 'bf16' or 'int8'")
        if self.activations == "mxfp8" and not self.packed:
            raise ConfigError("activations='mxfp8': MXFP8 activations feed the MXFP4 experts (W4A8); "
                              "needs expert_format='mxfp4'")

    @property
    def packed(self) -> bool:
        return self.expert_format == "mxfp4"

    def check(self, cfg: K3Config, *, kernel_limits: bool = False) -> None:
        """ConfigError naming the field if the ops cannot run `cfg` built this way; `kernel_limits` adds the
        Triton kernel (and TensorRT plugin) limits, always applied with kernels=triton."""
        cfg.check_ops(kernels=kernel_limits or self.kernels is Kernels.TRITON, packed_experts=self.packed)


@dataclass(frozen=True)
class CacheOptions:
    max_context: int | None = None  # static MLA latent cache of this many positions; None = growing

    def __post_init__(self) -> None:
        m = self.max_context
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ConfigError(f"max_context={str(m)[:80]}: must be None or an integer >= 1")

    @property
    def static(self) -> bool:
        return self.max_context is not None

    def check(self, cfg: K3Config) -> None:
        if self.max_context is not None and self.max_context > cfg.max_position_embeddings:
            raise ConfigError(f"max_context={self.max_context}: must be None or in [1, max_position_embeddings="
                              f"{cfg.max_position_embeddings}]")


@dataclass(frozen=True)
class ModelOptions:
    """What an export was built with, beside its architecture (the manifest's `options` entry)."""
    build: BuildOptions = field(default_factory=BuildOptions)
    cache: CacheOptions = field(default_factory=CacheOptions)

    def check(self, cfg: K3Config, *, kernel_limits: bool = False) -> None:
        self.build.check(cfg, kernel_limits=kernel_limits)
        self.cache.check(cfg)

    def to_dict(self) -> dict[str, Any]:
        return {"kernels": self.build.kernels.value, "expert_format": self.build.expert_format,
                "activations": self.build.activations, "trunk": self.build.trunk,
                "max_context": self.cache.max_context}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelOptions:
        if not isinstance(d, dict):
            raise ConfigError(f"options={str(d)[:80]}: must be an object")
        kernels = d.get("kernels", d.get("backend", "reference"))  # "backend": manifests before 0.2
        build = BuildOptions(kernels, d.get("expert_format", "dense"), d.get("activations", "bf16"),
                             d.get("trunk", "dense"))
        return cls(build, CacheOptions(d.get("max_context")))

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> ModelOptions:
        """The manifest's `options` entry; a manifest from before that entry: the options its config held."""
        if "options" in manifest:
            return cls.from_dict(manifest["options"])
        return cls.from_dict({k: v for k, v in (manifest.get("config") or {}).items() if k in LEGACY_OPTION_KEYS})
