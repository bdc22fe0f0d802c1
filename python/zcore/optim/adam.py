"""``CPUAdam`` / ``CPUAdamW``: torch.optim.Adam / AdamW on zcore's fused CPU
kernels.

Drop-in replacements for CPU parameters: the same arguments, the same update
(to fp32 rounding), the same ``state_dict`` layout (per parameter ``step`` as a
float32 scalar tensor, ``exp_avg``, ``exp_avg_sq``; the same param_group keys),
so a state_dict moves freely between these and torch's optimizers.
Parameters may be fp32 or bf16 (bf16 master weights), and ``state_dtype``
chooses the moments' dtype (fp32 or bf16; default: the parameter's, as
torch's); bf16 values are stepped in fp32 and rounded once. One native
call per param_group (per distinct step count within it) updates all of its
parameters on ``num_threads`` threads (default: ``torch.get_num_threads()`` at
each step). amsgrad is not supported.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from zcore.errors import InvalidArgumentError
from zcore.optim.functional import AdamConfig, adam_step
from zcore.memory.kernel_tensors import GRAD_DTYPES, MASTER_DTYPES, check_tensor


def group_config(group: dict[str, Any]) -> AdamConfig:
    """The hyper-parameters of one of CPUAdam's param_groups (a scheduler
    may have changed them since the last step)."""
    return AdamConfig(
        lr=float(group["lr"]),
        betas=tuple(float(b) for b in group["betas"]),
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        decoupled_weight_decay=group["decoupled_weight_decay"],
        maximize=group["maximize"],
    )


class CPUAdam(torch.optim.Optimizer):
    """torch.optim.Adam on zcore's fused CPU kernel.

    ``decoupled_weight_decay=True`` makes it AdamW, as in torch.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool = False,
        num_threads: int | None = None,
        state_dtype: torch.dtype | None = None,
    ) -> None:
        if amsgrad:
            raise InvalidArgumentError(
                "amsgrad=True is not supported by zcore's fused Adam; use torch.optim.Adam(amsgrad=True)"
            )
        AdamConfig(lr, tuple(betas), eps, weight_decay)  # torch's argument checks
        if num_threads is not None and num_threads < 1:
            raise InvalidArgumentError(f"num_threads={num_threads} must be >= 1", num_threads=num_threads)
        if state_dtype is not None and state_dtype not in MASTER_DTYPES:
            raise InvalidArgumentError(
                f"state_dtype={state_dtype} is not supported; Adam's moments are torch.float32 or torch.bfloat16",
                state_dtype=str(state_dtype),
            )
        self.num_threads = num_threads
        self.state_dtype = state_dtype
        # The keys of torch's Adam param_groups, so that state_dicts load both ways.
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": False,
            "maximize": maximize,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": decoupled_weight_decay,
        }
        super().__init__(params, defaults)
        # torch's load_state_dict casts every floating state to its
        # parameter's dtype; the moments keep state_dtype's values instead.
        self.register_load_state_dict_pre_hook(_keep_loaded_moments)
        self.register_load_state_dict_post_hook(_restore_loaded_moments)

    def state_dtype_of(self, p: torch.Tensor) -> torch.dtype:
        """The dtype of parameter ``p``'s moments."""
        return self.state_dtype or p.dtype

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("decoupled_weight_decay", False)
            for p in group["params"]:
                p_state = self.state.get(p, {})
                if "step" in p_state and not torch.is_tensor(p_state["step"]):
                    p_state["step"] = torch.tensor(float(p_state["step"]), dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.fused_step()
        return loss

    @torch.no_grad()
    def fused_step(
        self, grad_scale: float = 1.0, params_out: Mapping[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """``step()`` with the extras of the ZeRO offload path, in the same pass:
        gradients multiplied by ``grad_scale`` (1/loss_scale times the clipping
        coefficient) before use, and each parameter in ``params_out`` also
        written, rounded to nearest even, to its bf16/fp16 tensor there."""
        for group in self.param_groups:
            self._step_group(group, grad_scale, params_out)

    def _step_group(
        self,
        group: dict[str, Any],
        grad_scale: float,
        params_out: Mapping[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        if group["amsgrad"]:
            raise InvalidArgumentError("amsgrad=True is not supported by zcore's fused Adam")
        config = group_config(group)
        # Parameters are grouped by step count: one that had no gradient for a
        # while lags behind the others of its group, as in torch.
        by_step: dict[int, list[torch.Tensor]] = defaultdict(list)
        for index, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            self._check_param(p, index)
            state = self._state_for(p)
            by_step[int(state["step"].item()) + 1].append(p)
        for step, params in by_step.items():
            states = [self.state[p] for p in params]
            adam_step(
                config, step, params, [p.grad for p in params],
                [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                params_out=None if params_out is None else [params_out[p] for p in params],
                grad_scale=grad_scale,
                num_threads=self.num_threads,
            )
            for s in states:
                s["step"] += 1

    def _state_for(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        dtype = self.state_dtype_of(p)
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        for key in ("exp_avg", "exp_avg_sq"):
            if state[key].dtype != dtype:  # a state set by hand, not by load_state_dict
                raise InvalidArgumentError(
                    f"the {key} of a {p.dtype} parameter is {state[key].dtype}, but this CPUAdam keeps its "
                    f"moments in {dtype}: set it in that dtype, or build CPUAdam with state_dtype={state[key].dtype}",
                    dtype=str(state[key].dtype),
                )
        return state

    @staticmethod
    def _check_param(p: torch.Tensor, index: int) -> None:
        name = f"parameter {index} of its group"
        if p.grad.is_sparse:
            raise InvalidArgumentError(f"{name} has a sparse gradient; CPUAdam supports dense gradients only")
        check_tensor(p, name, MASTER_DTYPES, torch.device("cpu"))
        check_tensor(p.grad, f"the gradient of {name}", GRAD_DTYPES, torch.device("cpu"), p.numel())


_MOMENTS = ("exp_avg", "exp_avg_sq")


def _keep_loaded_moments(optimizer: CPUAdam, state_dict: dict[str, Any]) -> None:
    """Each parameter's moments in ``state_dict``, matched to the parameter
    as torch's load matches them (the saved groups' ids, in order)."""
    saved_ids = [i for group in state_dict.get("param_groups", []) for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    param_of = dict(zip(saved_ids, params))
    optimizer._loaded_moments = {
        param_of[index]: {k: state[k] for k in _MOMENTS if isinstance(state.get(k), torch.Tensor)}
        for index, state in state_dict.get("state", {}).items() if index in param_of
    }


def _restore_loaded_moments(optimizer: CPUAdam) -> None:
    for p, moments in optimizer.__dict__.pop("_loaded_moments", {}).items():
        if p in optimizer.state:
            for key, value in moments.items():
                optimizer.state[p][key] = value.to(dtype=optimizer.state_dtype_of(p), device=p.device)


class CPUAdamW(CPUAdam):
    """torch.optim.AdamW on zcore's fused CPU kernel (decoupled weight decay)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        num_threads: int | None = None,
        state_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad,
            maximize=maximize, decoupled_weight_decay=True, num_threads=num_threads, state_dtype=state_dtype,
        )
