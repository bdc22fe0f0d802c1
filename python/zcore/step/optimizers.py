"""Which parameters are trained, in which groups, and the optimizer over them.

The user's parameter groups (from a torch optimizer, ``model_parameters`` or
the whole model) decide the hyper-parameters; zcore builds or re-points the
optimizer at the pieces of its fp32 master shards, group by group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import torch

from zcore.config.schema import Config
from zcore.errors import ConfigError, InvalidArgumentError
from zcore.optim import CompressedAdam, CPUAdam, OneBitAdam, ZeroOneAdam
from zcore.optim.matrix_optimizer import MatrixAndElementwise, MatrixOptimizer, check_matrix_params
from zcore.optim.muon import Muon
from zcore.config.optimizer import MuonConfig, MuonParams, OneBitAdamConfig, ZeroOneAdamConfig
from zcore.config.policies import OffloadPolicy, Tier

# Optimizers whose update is element-wise, so that running them on any slice
# of a parameter gives that slice of the full update.
_ELEMENTWISE = (
    CPUAdam,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
)


@dataclass(frozen=True)
class ParamGroups:
    groups: list[dict]  # the user's groups: "params" (model parameters) + hyper-parameters
    trainable: list[torch.nn.Parameter]  # every trained parameter once, in group order
    # The first groups, those of the configured Muon's matrices (the rest: its AdamW's).
    matrix_groups: int = 0


def combine_optimizers(optimizer: Any) -> Any:
    """The optimizer zcore.initialize was given as one: a whole-matrix
    optimizer and an element-wise one (``(torch.optim.Muon(...),
    torch.optim.AdamW(...))``, over the user's split) as MatrixAndElementwise;
    a whole-matrix optimizer alone likewise; anything else as it is."""
    if isinstance(optimizer, (list, tuple)):
        matrix = [o for o in optimizer if _matrix_optimizer(o) is not None]
        others = [o for o in optimizer if _matrix_optimizer(o) is None]
        if len(optimizer) != 2 or len(matrix) != 1 or not isinstance(others[0], torch.optim.Optimizer):
            raise InvalidArgumentError(
                f"zcore.initialize(optimizer=...) takes a pair only as a whole-matrix optimizer (torch.optim.Muon "
                f"or a zcore.optim.MatrixOptimizer) and an element-wise torch optimizer (AdamW) for the other "
                f"parameters; got {[type(o).__name__ for o in optimizer]}",
                argument="optimizer",
            )
        return _combined(_matrix_optimizer(matrix[0]), others[0])
    matrix_alone = _matrix_optimizer(optimizer)
    if matrix_alone is not None:
        return _combined(matrix_alone, None)
    return optimizer


def _combined(matrix: MatrixOptimizer, elementwise: Optional[torch.optim.Optimizer]) -> MatrixAndElementwise:
    check_matrix_params(type(matrix).__name__, matrix.param_groups)  # the model's parameters, before re-pointing
    return MatrixAndElementwise(matrix, elementwise)


def _matrix_optimizer(optimizer: Any) -> Optional[MatrixOptimizer]:
    """zcore's view of a whole-matrix optimizer: itself, or for a
    torch.optim.Muon (torch 2.9 and later) a zcore Muon over its groups."""
    if isinstance(optimizer, MatrixOptimizer):
        return optimizer
    torch_muon = getattr(torch.optim, "Muon", None)
    if torch_muon is not None and isinstance(optimizer, torch_muon):
        return Muon.from_torch(optimizer)
    return None


def _has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s state comes from steps: some optimizers
    (Adagrad) create their state at construction, with step 0."""
    for state in optimizer.state.values():
        step = state.get("step")
        if step is None or float(step) > 0:
            return True
    return False


def collect_param_groups(
    model: torch.nn.Module,
    optimizer: Union[None, torch.optim.Optimizer, Callable],
    model_parameters: Optional[Iterable],
    configured: Any = None,
) -> ParamGroups:
    """``configured``: the config's optimizer section (a Muon's splits the groups)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if _has_stepped(optimizer):
            raise ValueError(
                "the optimizer passed to zcore.initialize already has state (it has stepped); "
                "pass a freshly constructed optimizer"
            )
        raw: list[Any] = list(optimizer.param_groups)
    elif model_parameters is not None:
        raw = list(model_parameters)
    else:
        raw = [{"params": list(model.parameters())}]
    if raw and not isinstance(raw[0], dict):
        raw = [{"params": raw}]

    names = {id(p): n for n, p in model.named_parameters()}
    groups, trainable, seen = [], [], set()
    for group in raw:
        params = [p for p in group["params"] if p.requires_grad]
        for p in params:
            if id(p) not in names:
                raise ValueError(
                    f"a parameter of shape={tuple(p.shape)} in the optimizer's groups is not a "
                    "parameter of the model; give zcore.initialize the model that owns it"
                )
            if id(p) in seen:
                raise ValueError(
                    f"parameter {names[id(p)]!r} appears in more than one parameter group; "
                    "put it in one"
                )
            seen.add(id(p))
            trainable.append(p)
        groups.append({**group, "params": params})

    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(
            f"parameters {missing[:5]}{' ...' if len(missing) > 5 else ''} require grad but are in "
            "no optimizer group; add them to the optimizer or set requires_grad=False"
        )
    dtypes = {p.dtype for p in trainable}
    if len(dtypes) > 1 or any(not p.is_floating_point() for p in trainable):
        raise ValueError(
            f"trainable parameters must share one floating-point dtype, found {sorted(map(str, dtypes))}; "
            "build the model in fp32 and let bf16/fp16 in the config choose the compute dtype"
        )
    if not trainable:
        raise ValueError("the model has no parameter that requires grad: nothing to train")
    if isinstance(configured, MuonConfig) and optimizer is None:
        return _muon_split(groups, names, configured.params)
    return ParamGroups(groups=groups, trainable=trainable)


# The keys of a user's group that each half of DeepSpeed's Muon split takes.
_MUON_KEYS = ("lr", "momentum", "weight_decay")
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


def uses_muon(name: str, p: torch.nn.Parameter) -> bool:
    """DeepSpeed's split: Muon for parameters of two or more dimensions whose
    names hold neither "embed" nor "lm_head"; a ``use_muon`` attribute the
    user set on the parameter decides instead."""
    chosen = getattr(p, "use_muon", None)
    if chosen is not None:
        return bool(chosen)
    return p.dim() >= 2 and not any(word in name.lower() for word in ("embed", "lm_head"))


def _muon_split(groups: list[dict], names: dict[int, str], params: MuonParams) -> ParamGroups:
    """Each group's Muon half, then each group's AdamW half (empty halves
    dropped), with the config's values under the group's own, as DeepSpeed
    resolves them."""
    muon_defaults = {"lr": params.muon_step_size, "momentum": params.momentum, "weight_decay": params.weight_decay}
    adam_defaults = {"lr": params.adam_step_size, "betas": params.betas, "eps": params.eps,
                     "weight_decay": params.weight_decay}
    halves: dict[bool, list[dict]] = {True: [], False: []}
    for group in groups:
        for muon, keys, defaults in ((True, _MUON_KEYS, muon_defaults), (False, _ADAM_KEYS, adam_defaults)):
            half = [p for p in group["params"] if uses_muon(names[id(p)], p) is muon]
            if half:
                own = {k: v for k, v in group.items() if k in keys}
                halves[muon].append({"params": half, **defaults, **own})
    ordered = halves[True] + halves[False]
    check_matrix_params("Muon (a parameter with use_muon set)", halves[True])
    return ParamGroups(
        groups=ordered, trainable=[p for g in ordered for p in g["params"]], matrix_groups=len(halves[True])
    )


def build_optimizer(
    optimizer: Union[None, torch.optim.Optimizer, Callable],
    cfg: Config,
    offload: OffloadPolicy,
    groups: ParamGroups,
    pieces: dict[int, list[torch.nn.Parameter]],
) -> torch.optim.Optimizer:
    """The optimizer over master pieces, with the user's group
    hyper-parameters, keeping its moments in the configured dtype."""
    piece_groups = [
        {**g, "params": [piece for p in g["params"] for piece in pieces.get(id(p), [])]}
        for g in groups.groups
    ]
    if optimizer is not None and cfg.optimizer is not None:
        raise ConfigError(
            "an optimizer is both configured (config key 'optimizer') and passed to "
            "zcore.initialize(optimizer=...); keep one"
        )
    if optimizer is not None:
        built = _given_optimizer(optimizer, cfg, offload, piece_groups)
    else:
        built = _configured_optimizer(cfg, offload, piece_groups, groups.matrix_groups)
    _take_state_dtype(built, cfg, offload)
    return built


def _given_optimizer(
    optimizer: Union[torch.optim.Optimizer, Callable], cfg: Config, offload: OffloadPolicy, piece_groups: list[dict]
) -> torch.optim.Optimizer:
    """The optimizer passed to zcore.initialize, or the one its callable
    builds, over the pieces."""
    if isinstance(optimizer, torch.optim.Optimizer):
        _check_compressed(optimizer, cfg, offload)
        _check_elementwise(optimizer, cfg)
        _check_swappable(optimizer, offload)
        # Re-point the user's optimizer (so schedulers built on it keep working).
        for group, new in zip(optimizer.param_groups, piece_groups):
            group["params"] = new["params"]
        if isinstance(optimizer, MatrixAndElementwise):
            if optimizer.elementwise is not None:
                _remake_construction_state(optimizer.elementwise)
        else:
            _remake_construction_state(optimizer)
        return optimizer
    built = optimizer(piece_groups)
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(
            f"the optimizer callable returned {type(built).__name__}, not a torch.optim.Optimizer"
        )
    _check_compressed(built, cfg, offload)
    _check_elementwise(built, cfg)
    _check_swappable(built, offload)
    return built


def _configured_optimizer(
    cfg: Config, offload: OffloadPolicy, piece_groups: list[dict], matrix_groups: int
) -> torch.optim.Optimizer:
    """The config's optimizer section's optimizer over the pieces
    (``matrix_groups``: the first groups, a configured Muon's)."""
    if cfg.optimizer is None:
        raise ConfigError(
            "no optimizer: add an 'optimizer' section to the config (type Adam or AdamW) or pass "
            "zcore.initialize(optimizer=...)"
        )
    if isinstance(cfg.optimizer, (OneBitAdamConfig, ZeroOneAdamConfig)):
        compressed = _compressed_adam(cfg.optimizer, piece_groups)
        _check_compressed(compressed, cfg, offload)
        return compressed
    if isinstance(cfg.optimizer, MuonConfig):
        built = _muon_and_adamw(piece_groups, matrix_groups, cfg.optimizer.params.ns_method, offload)
        _check_swappable(built, offload)
        return built
    p = cfg.optimizer.params
    decoupled = cfg.optimizer.decoupled_weight_decay
    if offload.optimizer is Tier.NVME and p.torch_adam:
        raise ConfigError(
            "optimizer.params.torch_adam = true cannot step optimizer states on NVMe, which "
            "zcore's fused CPU Adam streams from disk; remove torch_adam or set "
            "zero_optimization.offload_optimizer.device to 'cpu' or 'none'"
        )
    if offload.optimizer is not Tier.DEVICE and not p.torch_adam:
        # ZeRO-Offload: zcore's fused CPU kernel on the host master shards.
        return CPUAdam(
            piece_groups, lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay,
            decoupled_weight_decay=decoupled,
        )
    kind = torch.optim.AdamW if decoupled else torch.optim.Adam
    return kind(piece_groups, lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay)


def _muon_and_adamw(
    piece_groups: list[dict], matrix_groups: int, ns_method: str, offload: OffloadPolicy
) -> torch.optim.Optimizer:
    """The configured Muon over the first ``matrix_groups`` groups (whose
    values the split set: zcore.config.optimizer.MuonParams), iterating by
    ``ns_method``, and AdamW over the others, zcore's fused CPU AdamW where
    the optimizer is offloaded (DeepSpeed's choice too); AdamW alone where
    no parameter is a matrix."""
    matrices, others = piece_groups[:matrix_groups], piece_groups[matrix_groups:]
    adamw = None
    if others:
        adamw = (
            CPUAdam(others, decoupled_weight_decay=True) if offload.optimizer is not Tier.DEVICE
            else torch.optim.AdamW(others)
        )
    if not matrices:
        assert adamw is not None  # collect_param_groups found something to train
        return adamw
    # torch.optim.Muon's nesterov and Newton-Schulz coefficients and steps, as DeepSpeed's Muon has them.
    return MatrixAndElementwise(Muon(matrices, ns_method=ns_method), adamw)


def _remake_construction_state(optimizer: torch.optim.Optimizer) -> None:
    """State an optimizer made at construction (Adagrad's sums, unstepped:
    _has_stepped refused any other) was made for the model's parameters;
    it is made again for the master pieces it now updates, as a twin of the
    same class and hyper-parameters makes it (torch before 2.13 expects it
    there at the first step rather than making it then)."""
    if not optimizer.state:
        return
    twin = type(optimizer)([dict(group) for group in optimizer.param_groups], **optimizer.defaults)
    optimizer.state.clear()
    optimizer.state.update(twin.state)


def _compressed_adam(
    config: Union[OneBitAdamConfig, ZeroOneAdamConfig], piece_groups: list[dict]
) -> CompressedAdam:
    """The configured 1-bit Adam or 0/1 Adam; the keys DeepSpeed takes and
    never applies were checked by the config and change nothing here."""
    p = config.params
    adam = {"lr": p.lr, "betas": p.betas, "eps": p.eps, "weight_decay": p.weight_decay}
    if isinstance(config, OneBitAdamConfig):
        return OneBitAdam(piece_groups, freeze_step=p.freeze_step, **adam)
    return ZeroOneAdam(
        piece_groups, var_freeze_step=p.var_freeze_step, var_update_scaler=p.var_update_scaler,
        local_step_scaler=p.local_step_scaler, local_step_clipper=p.local_step_clipper, **adam,
    )


def _check_compressed(optimizer: torch.optim.Optimizer, cfg: Config, offload: OffloadPolicy) -> None:
    """1-bit Adam and 0/1 Adam take the place of stage 0's gradient
    all-reduce on their compressed steps: they need every rank to hold whole
    gradients and to step on the device (DeepSpeed allows them without ZeRO only)."""
    if not isinstance(optimizer, CompressedAdam):
        return
    name = type(optimizer).__name__
    stage = cfg.zero_optimization.stage
    if stage != 0:
        raise ConfigError(
            f"{name} averages each rank's whole gradients or momentum itself, in 1-bit messages, in "
            f"place of ZeRO stage 0's all-reduce; zero_optimization.stage is {stage}, which reduce-scatters "
            "gradients into shards (DeepSpeed refuses ZeRO with it too): set zero_optimization.stage to 0"
        )
    if offload.optimizer is not Tier.DEVICE:
        raise ConfigError(
            f"{name} steps where its compressed all-reduce runs, on the device, but "
            f"zero_optimization.offload_optimizer.device is {offload.optimizer.value!r} (DeepSpeed offloads "
            "only under ZeRO, which it refuses with this optimizer): set offload_optimizer.device to 'none'"
        )


def _check_swappable(optimizer: torch.optim.Optimizer, offload: OffloadPolicy) -> None:
    if offload.optimizer is Tier.NVME and isinstance(optimizer, MatrixAndElementwise):
        keys = type(optimizer.matrix).state_keys
        if len(keys) > 2:
            raise ConfigError(
                f"zero_optimization.offload_optimizer.device = 'nvme' keeps a whole-matrix optimizer's per-element "
                f"states where Adam's two moments rest; {type(optimizer.matrix).__name__} declares "
                f"{len(keys)} (its state_keys): at most two fit, or set offload_optimizer.device to 'cpu'"
            )
        if optimizer.elementwise is not None:
            _check_swappable(optimizer.elementwise, offload)
        return
    if offload.optimizer is Tier.NVME and not isinstance(optimizer, CPUAdam):
        raise ConfigError(
            f"zero_optimization.offload_optimizer.device = 'nvme' steps the states on disk with "
            f"zcore's fused CPU Adam, not {type(optimizer).__name__}: pass zcore.optim.CPUAdam or "
            "CPUAdamW (or configure an 'optimizer' section of type Adam or AdamW)"
        )


def _take_state_dtype(
    optimizer: torch.optim.Optimizer, cfg: Config, offload: OffloadPolicy, whole: Optional[torch.optim.Optimizer] = None
) -> None:
    """The optimizer's moments in the dtype the config asks
    (bf16.bf16_optimizer_states): zcore's CPUAdam keeps any; a torch
    optimizer keeps its states in its parameters' (the master's) dtype, so
    bf16 master weights beside fp32 moments need CPUAdam, as in DeepSpeed.
    ``whole``: the optimizer ``optimizer`` is part of (for the message)."""
    bf16 = cfg.bf16
    states = torch.bfloat16 if bf16.bf16_optimizer_states else torch.float32
    if isinstance(optimizer, MatrixAndElementwise):
        parts: list[torch.optim.Optimizer] = [optimizer.matrix]
        parts += [optimizer.elementwise] if optimizer.elementwise is not None else []
        for part in parts:
            _take_state_dtype(part, cfg, offload, whole=optimizer)
        return
    if isinstance(optimizer, CPUAdam):
        if optimizer.state_dtype is not None and optimizer.state_dtype != states:
            raise ConfigError(
                f"the CPUAdam passed to zcore.initialize keeps its moments in {optimizer.state_dtype}, but "
                f"bf16.bf16_optimizer_states = {bf16.bf16_optimizer_states} asks for {states}: build it with "
                f"state_dtype={states} (or None), or change the config"
            )
        optimizer.state_dtype = states
        return
    if bf16.bf16_master_weights_and_grads and not bf16.bf16_optimizer_states:
        if isinstance(whole, MatrixAndElementwise) and optimizer is whole.matrix:
            otherwise = ""  # Muon's momentum follows its parameters on every tier
        elif offload.optimizer is Tier.DEVICE:
            otherwise = (
                ", or set zero_optimization.offload_optimizer.device to 'cpu' (zcore's CPU Adam keeps fp32 "
                "moments beside bf16 weights)"
            )
        else:
            otherwise = (
                ", or let zcore's CPU Adam step (an Adam or AdamW optimizer section without torch_adam, or "
                "zcore.optim.CPUAdam), which keeps fp32 moments beside bf16 weights"
            )
        raise ConfigError(
            f"bf16.bf16_master_weights_and_grads without bf16_optimizer_states keeps fp32 moments beside bf16 "
            f"master weights, but {type(optimizer).__name__} keeps its states in its parameters' dtype (bf16): set "
            f"bf16.bf16_optimizer_states to true{otherwise}"
        )


def _check_elementwise(optimizer: torch.optim.Optimizer, cfg: Config) -> None:
    stage = cfg.zero_optimization.stage
    if isinstance(optimizer, MatrixAndElementwise):  # the matrices step whole (zcore.step.matrix_step)
        if optimizer.elementwise is not None:
            _check_elementwise(optimizer.elementwise, cfg)
        return
    if stage == 0 or isinstance(optimizer, _ELEMENTWISE) or cfg.zero_allow_untested_optimizer:
        return
    raise ConfigError(
        f"{type(optimizer).__name__} is not known to update element-wise, and ZeRO stage {stage} "
        "runs it on slices of parameters; if its update is element-wise, set "
        "'zero_allow_untested_optimizer': true in the config"
    )
