"""Which configuration fits: zcore.plan.estimate's figures for each stage and
offload choice, cheapest first, against device, host and NVMe budgets
(``zcore.recommend_config`` and ``zcore estimate``'s recommendation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from zcore.plan.activation_estimate import SampleInput
from zcore.config.schema import Config, load_config
from zcore.errors import InvalidArgumentError
from zcore.plan.estimate import ConfigArg, MemoryEstimate, Planner, choice_label, size_text, sizes_text
from zcore.observe.memory_report import DEVICE, HOST, NVME, TIER_NAMES
from zcore.config.policies import Tier


@dataclass(frozen=True)
class Choice:
    """One of CHOICES for a model: its config section and estimate, or why it has none."""

    label: str
    zero_optimization: dict
    estimate: Optional[MemoryEstimate]
    skipped: str = ""  # why there is no estimate

    def __str__(self) -> str:
        return str(self.estimate) if self.estimate is not None else f"{self.label}: not estimated: {self.skipped}"


@dataclass(frozen=True)
class Recommendation:
    zero_optimization: dict  # the config's zero_optimization section to use
    estimate: MemoryEstimate
    reasons: tuple[str, ...]  # why each cheaper choice was passed over, then why this one fits

    def __str__(self) -> str:
        return "\n".join(["recommended: " + self.estimate.label, *[f"- {r}" for r in self.reasons]])


# The choices, cheapest first: least communication, then least offload
# traffic (zero_optimization.stage, offload_optimizer.device, offload_param.device).
CHOICES = (
    (0, "none", "none"),
    (1, "none", "none"),
    (2, "none", "none"),
    (3, "none", "none"),
    (2, "cpu", "none"),
    (3, "cpu", "none"),
    (3, "cpu", "cpu"),
    (3, "nvme", "cpu"),
    (3, "nvme", "nvme"),
)


def recommend_config(
    model_or_param_count: Union[torch.nn.Module, int],
    config: ConfigArg,
    world_size: int,
    *,
    device_memory: int,
    host_memory: int,
    nvme_memory: Optional[int] = None,
    ranks_per_node: int = 1,
    nvme_path: Optional[str] = None,
    device: str = "cuda",
    sample_input: Optional[SampleInput] = None,
    activations: Optional[int] = None,
) -> Recommendation:
    """The cheapest choice in CHOICES that fits: ``device_memory`` bytes per
    device, ``host_memory`` and ``nvme_memory`` (None: not checked) bytes
    per node of ``ranks_per_node`` ranks. NVMe choices need an nvme_path
    (the config's or ``nvme_path``). Other keys of ``config`` are kept.

    Activations must be known: measured from ``sample_input`` (token ids
    of micro-batch x sequence length; for a bare count they run through a
    GPT-like shape assumed from it, named in the estimate) or given as
    ``activations`` bytes. Without them no choice is called fitting: the
    error names the cheapest that fits without them and what to pass."""
    planner = Planner(model_or_param_count, config, device=device, sample_input=sample_input,
                      activations=activations, host_available=host_memory)
    budget = Budget(device_memory, host_memory, nvme_memory, ranks_per_node)
    return recommend(planner, world_size, budget, nvme_path)


@dataclass(frozen=True)
class Budget:
    device: int  # bytes per device
    host: int  # bytes per node
    nvme: Optional[int]  # bytes per node; None: not checked
    ranks_per_node: int

    def __post_init__(self) -> None:
        for name, value in (("device_memory", self.device), ("host_memory", self.host),
                            ("nvme_memory", self.nvme), ("ranks_per_node", self.ranks_per_node)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}", argument=name)

    def overruns(self, estimate: MemoryEstimate) -> list[str]:
        """What ``estimate`` needs beyond the budget, in words (empty: it fits)."""
        k = self.ranks_per_node
        needs = [("device", estimate.total(DEVICE), self.device, "per device"),
                 ("host", k * estimate.total(HOST), self.host, f"per node of {k} rank{'s' * (k > 1)}")]
        if self.nvme is not None:
            needs.append(("nvme", k * estimate.total(NVME), self.nvme, f"per node of {k} rank{'s' * (k > 1)}"))
        return [f"{tier} {' > '.join(sizes_text(need, have))} budget {where}"
                for tier, need, have, where in needs if need > have]

    def use(self, estimate: MemoryEstimate) -> str:
        k = self.ranks_per_node
        parts = [f"device {size_text(estimate.total(DEVICE))} of {size_text(self.device)}",
                 f"host {size_text(k * estimate.total(HOST))} of {size_text(self.host)}"]
        if estimate.total(NVME):
            of = f" of {size_text(self.nvme)}" if self.nvme is not None else " (NVMe space not checked)"
            parts.append(f"nvme {size_text(k * estimate.total(NVME))}{of}")
        return ", ".join(parts)


def choices(planner: Planner, world_size: int, nvme_path: Optional[str]) -> list[Choice]:
    """Each of CHOICES, with the other keys of the config as given."""
    raw = planner.config.model_dump(exclude_unset=True)
    path = nvme_path or _nvme_path(planner.config)
    out = []
    for stage, optimizer, parameters in CHOICES:
        label = choice_label(stage, TIER_NAMES[Tier(optimizer)], TIER_NAMES[Tier(parameters)])
        zero = _choice_section(raw.get("zero_optimization", {}), stage, optimizer, parameters, path)
        if zero is None:
            out.append(Choice(label, {}, None, "no nvme_path: give one (--nvme-path) to consider NVMe"))
            continue
        cfg = load_config({**raw, "zero_optimization": zero})
        out.append(Choice(label, zero, planner.estimate(cfg, world_size)))
    return out

def recommend(planner: Planner, world_size: int, budget: Budget, nvme_path: Optional[str]) -> Recommendation:
    reasons = []
    for choice in choices(planner, world_size, nvme_path):
        estimate = choice.estimate
        if estimate is None:
            reasons.append(f"{choice.label}: not considered: {choice.skipped}")
            continue
        overruns = budget.overruns(estimate)
        if not overruns:
            if planner.activations is None:  # it fits without them: unknown whether it fits with them
                raise _activations_needed(planner, estimate, budget)
            reasons.append(f"{choice.label} fits: {budget.use(estimate)}")
            return Recommendation(choice.zero_optimization, estimate, tuple(reasons))
        reasons.append(f"{choice.label} does not fit: {'; '.join(overruns)}")
    unknown = "" if planner.activations is not None else " (activations unknown, not counted: they only add)"
    raise InvalidArgumentError(
        f"no configuration fits at world size {world_size}{unknown}:\n" + "\n".join(f"- {r}" for r in reasons)
        + f"\n{_fix(planner, world_size, budget, nvme_path)}",
        world_size=world_size,
    )


def _activations_needed(planner: Planner, estimate: MemoryEstimate, budget: Budget) -> InvalidArgumentError:
    """No choice is called fitting while activations, often most of the
    device, are left out: the cheapest that fits without them, and what to
    pass to count them."""
    module = planner.model.module
    if module is None:
        how = "; for a bare parameter count, through a GPT-like shape assumed from it, printed with the figures"
    else:
        longest = _longest_sequence(module)
        how = f"; the model's config allows up to {longest} positions" if longest else ""
    return InvalidArgumentError(
        f"{planner.activation_note}, so nothing is recommended: the cheapest choice that fits without them, "
        f"{estimate.label}, leaves {size_text(budget.device - estimate.total(DEVICE))} of the "
        f"{size_text(budget.device)} device for them. Give a sequence length to measure them: zcore estimate "
        "--seq-len N (and --batch B, default the config's micro-batch), or "
        f"sample_input=torch.zeros(B, N, dtype=torch.long) in Python{how}; or their bytes: --activations 6GiB, "
        "or activations=<bytes>",
        argument="activations",
    )


def _longest_sequence(module: torch.nn.Module) -> Optional[int]:
    """A transformers model's max_position_embeddings (n_positions, ...), if it has one."""
    value = getattr(getattr(module, "config", None), "max_position_embeddings", None)
    return value if isinstance(value, int) else None


def _fix(planner: Planner, world_size: int, budget: Budget, nvme_path: Optional[str]) -> str:
    """What would make a choice fit, in words: the smallest world size
    (doubling, up to 65536) where one does, else what to change."""
    if planner.activations is not None and planner.activations >= budget.device:
        return (f"activations alone take {size_text(planner.activations)} per device: lower the micro-batch "
                "or the sequence length, or checkpoint activations")
    world = world_size * 2
    while world <= 1 << 16:
        for choice in choices(planner, world, nvme_path):
            if choice.estimate is not None and not budget.overruns(choice.estimate):
                return f"at world size {world}, {choice.label} fits: add ranks, or raise the budgets"
        world *= 2
    if nvme_path or _nvme_path(planner.config):
        return "raise the budgets"
    return "raise the budgets, or give an nvme_path for NVMe offload"



def _choice_section(zero: dict, stage: int, optimizer: str, parameters: str, path: Optional[str]) -> Optional[dict]:
    """The user's zero_optimization section with this choice's stage and
    offload devices (None: an NVMe choice without a path)."""
    if "nvme" in (optimizer, parameters) and path is None:
        return None
    section = {**zero, "stage": stage}
    for key, device in (("offload_optimizer", optimizer), ("offload_param", parameters)):
        given = section.get(key, {})
        offload = {k: v for k, v in given.items() if k not in ("device", "nvme_path")}
        if device != "none":
            offload["device"] = device
        if device == "nvme":
            offload["nvme_path"] = given.get("nvme_path") or path
            if key == "offload_param":
                offload.setdefault("max_in_cpu", 0)  # NVMe is chosen because the host is short
        if offload:
            section[key] = offload
        else:
            section.pop(key, None)
    return section


def _nvme_path(cfg: Config) -> Optional[str]:
    zero = cfg.zero_optimization
    return zero.offload_optimizer.nvme_path or zero.offload_param.nvme_path
