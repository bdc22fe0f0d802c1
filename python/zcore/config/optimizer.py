"""The optimizer section of zcore's config: DeepSpeed's Adam, AdamW, 1-bit
Adam, 0/1 Adam and Muon, their params, and the union zcore.config.schema.Config takes.

The optimizers themselves are built from these in zcore.step.optimizers; 1-bit
Adam and 0/1 Adam run at ZeRO stage 0 only, which is checked there.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag, field_validator

from zcore.config.keys import show_value
from zcore.config.section import Section


class _AdamHyperParams(Section):
    """The hyper-parameters every optimizer type takes."""

    lr: float = Field(1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_from_json(cls, v: Any) -> Any:
        return _betas_from_json(v)

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        return _betas_in_range(v)


def _betas_from_json(v: Any) -> Any:
    # JSON has no tuples: a list of two is the same value.
    return tuple(v) if isinstance(v, list) else v


def _betas_in_range(v: tuple[float, float]) -> tuple[float, float]:
    if not all(0.0 <= b < 1.0 for b in v):
        raise ValueError(f"betas must both lie in [0, 1), got {v}")
    return v


# What zcore's Adam always does, for the DeepSpeed switch of each name.
_ALWAYS = {
    "adam_w_mode": "decays weights decoupled (AdamW)",
    "bias_correction": "corrects the moments' bias",
    "fp32_optimizer_states": "keeps its states in fp32",
}


def _always(v: bool, who: str, key: str) -> bool:
    """A DeepSpeed switch zcore takes only at true: what ``who`` always does."""
    if not v:
        raise ValueError(f"{who} always {_ALWAYS[key]}; remove the key or set it to true")
    return v


class AdamParams(_AdamHyperParams):
    # DeepSpeed's Adam defaults to decoupled weight decay (AdamW); False gives
    # torch.optim.Adam's L2 penalty.
    adam_w_mode: bool = True
    torch_adam: bool = False
    amsgrad: Literal[False] = False
    # DeepSpeed's fused and CPU Adam take these two; zcore's Adam always
    # corrects the moments' bias, and keeps its states in fp32 unless
    # bf16.bf16_optimizer_states asks for bf16 (with which DeepSpeed's CPU
    # Adam wants false here: zcore.config.schema checks the two agree).
    bias_correction: bool = True
    fp32_optimizer_states: bool = True

    @field_validator("bias_correction")
    @classmethod
    def _what_zcore_does(cls, v: bool, info: Any) -> bool:
        return _always(v, "zcore's Adam", info.field_name)


class _CompressedAdamParams(_AdamHyperParams):
    """What DeepSpeed's 1-bit Adam and 0/1 Adam both take (zcore.optim.compressed_adam)."""

    # DeepSpeed takes these three and never applies them: no bias correction
    # whatever bias_correction says, eps outside the square root, no clipping
    # by max_grad_norm. zcore does the same, and refuses a value that asks
    # for what neither does.
    bias_correction: bool = True
    eps_inside_sqrt: bool = False
    max_grad_norm: float = 0.0
    amsgrad: Literal[False] = False
    # Whether DeepSpeed's MPI implementation may hand MPI GPU memory.
    cuda_aware: bool = False
    # DeepSpeed's implementation of the compressed all-reduce. zcore's sends
    # the same messages through torch.distributed whatever the process
    # group's backend: "nccl" (the default), "gloo" and "compressed" (DeepSpeed's
    # backend-agnostic one) all choose it.
    comm_backend_name: str = "nccl"

    @field_validator("eps_inside_sqrt")
    @classmethod
    def _eps_outside(cls, v: bool) -> bool:
        if v:
            raise ValueError(
                "DeepSpeed's 1-bit Adam and 0/1 Adam take eps_inside_sqrt but always add eps outside the "
                "square root, as zcore does; remove the key or set it to false"
            )
        return v

    @field_validator("max_grad_norm")
    @classmethod
    def _no_clipping_here(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError(
                "DeepSpeed's 1-bit Adam and 0/1 Adam keep max_grad_norm but never clip with it; clip with "
                "the top-level key gradient_clipping, and remove this one (or set it to 0)"
            )
        return v

    @field_validator("cuda_aware")
    @classmethod
    def _no_mpi(cls, v: bool) -> bool:
        if v:
            raise ValueError(
                "cuda_aware tells DeepSpeed's MPI implementation that MPI reads GPU memory; zcore has no MPI "
                "implementation (comm_backend_name 'nccl' or 'gloo' go through torch.distributed): remove "
                "the key or set it to false"
            )
        return v

    @field_validator("comm_backend_name")
    @classmethod
    def _torch_distributed(cls, v: str) -> str:
        refused = {
            "mpi": "DeepSpeed's MPI implementation (mpi4py), which zcore does not have",
            "hccl": "DeepSpeed's implementation for Huawei Ascend devices, which zcore does not run on",
        }
        if v in refused:
            raise ValueError(
                f"comm_backend_name {show_value(v)} selects {refused[v]}; zcore sends the same 1-bit messages "
                "through torch.distributed: use 'nccl' (or 'gloo' on CPU)"
            )
        if v not in ("nccl", "gloo", "compressed"):
            raise ValueError(f"comm_backend_name must be 'nccl', 'gloo' or 'compressed', got {show_value(v)}")
        return v


class OneBitAdamParams(_CompressedAdamParams):
    # Exact Adam steps before compression (warm-up). DeepSpeed's first step
    # only sets up buffers, so it always takes at least one exact step: zcore
    # asks for one.
    freeze_step: int = Field(100_000, ge=1)


class ZeroOneAdamParams(_CompressedAdamParams):
    # The last variance update comes at step var_freeze_step + 1 at the latest.
    var_freeze_step: int = Field(100_000, ge=0)
    # Variance updates per interval before the interval doubles (the paper's kappa).
    var_update_scaler: int = Field(16, ge=1)
    # Local steps per synchronisation interval before the interval doubles.
    local_step_scaler: int = Field(32678, ge=1)
    # The longest synchronisation interval, in steps (the paper's H).
    local_step_clipper: int = Field(16, ge=1)


# zcore.optim.muon.NS_METHODS, restated: the config does not import torch.
_NS_METHODS = ("standard", "gram")


class MuonParams(Section):
    """DeepSpeed's Muon keys: Muon (torch.optim.Muon's math, or DeepSpeed's
    Gram iteration by ``ns_method``) for the matrices, AdamW for the other
    parameters (zcore.step.optimizers splits them as DeepSpeed does). ``lr``
    and ``weight_decay`` serve both halves; ``muon_lr`` and ``adam_lr``
    override ``lr`` for one. The defaults are DeepSpeed's, but for
    ``ns_method``."""

    lr: Optional[float] = Field(None, gt=0)
    muon_lr: Optional[float] = Field(None, gt=0)
    adam_lr: Optional[float] = Field(None, gt=0)
    momentum: float = Field(0.95, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-10, gt=0)
    # zcore's default is torch.optim.Muon's iteration; DeepSpeed's is "gram".
    ns_method: str = "standard"
    # DeepSpeed's Muon reads these for its AdamW half and its split; zcore's
    # AdamW half is decoupled, fp32, and torch's math whichever kernel runs it.
    adam_w_mode: bool = True
    torch_adam: bool = False
    foreach: Optional[bool] = None
    fp32_optimizer_states: bool = True
    per_head_muon: bool = False

    @field_validator("adam_w_mode", "fp32_optimizer_states")
    @classmethod
    def _adamw_in_fp32(cls, v: bool, info: Any) -> bool:
        return _always(v, "the AdamW half of zcore's Muon", info.field_name)

    @field_validator("per_head_muon")
    @classmethod
    def _whole_matrices(cls, v: bool) -> bool:
        if v:
            raise ValueError(
                "per_head_muon (orthogonalising each attention head's rows apart) is not implemented by zcore, "
                "whose Muon orthogonalises each matrix whole, as torch.optim.Muon does: remove the key or set "
                "it to false"
            )
        return v

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_from_json(cls, v: Any) -> Any:
        return _betas_from_json(v)

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        return _betas_in_range(v)

    @field_validator("ns_method")
    @classmethod
    def _known_iteration(cls, v: str) -> str:
        if v not in _NS_METHODS:
            raise ValueError(
                f"ns_method must be 'standard' (torch.optim.Muon's iteration) or 'gram' (DeepSpeed's Gram "
                f"Newton-Schulz), got {show_value(v)}"
            )
        return v

    @property
    def muon_step_size(self) -> float:
        """Muon's learning rate: muon_lr, else lr, else DeepSpeed's 0.02."""
        return self.muon_lr if self.muon_lr is not None else self.lr if self.lr is not None else 0.02

    @property
    def adam_step_size(self) -> float:
        """AdamW's learning rate: adam_lr, else lr, else DeepSpeed's 3e-4."""
        return self.adam_lr if self.adam_lr is not None else self.lr if self.lr is not None else 3e-4


class MuonConfig(Section):
    type: Literal["Muon"]
    params: MuonParams = MuonParams()

    @field_validator("type", mode="before")
    @classmethod
    def _canonical(cls, v: Any) -> Any:
        return _canonical_type(v)


# DeepSpeed reads optimizer types in any case.
_OPTIMIZER_TYPES = {
    "adam": "Adam", "adamw": "AdamW", "onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "muon": "Muon",
}


def _canonical_type(v: Any) -> Any:
    return _OPTIMIZER_TYPES.get(v.lower(), v) if isinstance(v, str) else v


class AdamOptimizerConfig(Section):
    type: str
    params: AdamParams = AdamParams()

    @field_validator("type")
    @classmethod
    def _known_type(cls, v: str) -> str:
        canonical = _canonical_type(v)
        if canonical not in ("Adam", "AdamW"):
            raise ValueError(
                f"optimizer type {show_value(v)} is not supported; use 'Adam', 'AdamW', 'OneBitAdam', "
                "'ZeroOneAdam' or 'Muon', or pass a torch optimizer (or a callable building one) to "
                "zcore.initialize(optimizer=...)"
            )
        return canonical

    @property
    def decoupled_weight_decay(self) -> bool:
        return self.type == "AdamW" or self.params.adam_w_mode


class OneBitAdamConfig(Section):
    type: Literal["OneBitAdam"]
    params: OneBitAdamParams = OneBitAdamParams()

    @field_validator("type", mode="before")
    @classmethod
    def _canonical(cls, v: Any) -> Any:
        return _canonical_type(v)


class ZeroOneAdamConfig(Section):
    type: Literal["ZeroOneAdam"]
    params: ZeroOneAdamParams = ZeroOneAdamParams()

    @field_validator("type", mode="before")
    @classmethod
    def _canonical(cls, v: Any) -> Any:
        return _canonical_type(v)


def _optimizer_branch(raw: Any) -> str:
    tag = _canonical_type(raw.get("type") if isinstance(raw, dict) else getattr(raw, "type", None))
    # Adam, AdamW and whatever zcore lacks go to the Adam section, whose
    # check names the types there are. Its tag is its class name, which is
    # what zcore.config.schema's _describe takes a type-less branch's name in an
    # error to be.
    return tag if tag in ("OneBitAdam", "ZeroOneAdam", "Muon") else AdamOptimizerConfig.__name__


# The params' keys depend on the type.
OptimizerConfig = Annotated[
    Union[
        Annotated[AdamOptimizerConfig, Tag(AdamOptimizerConfig.__name__)],
        Annotated[OneBitAdamConfig, Tag("OneBitAdam")],
        Annotated[ZeroOneAdamConfig, Tag("ZeroOneAdam")],
        Annotated[MuonConfig, Tag("Muon")],
    ],
    Discriminator(_optimizer_branch),
]
