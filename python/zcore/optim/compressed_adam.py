"""What 1-bit Adam and 0/1 Adam share: Adam's moments without bias
correction, their own communication on some steps, error feedback.

DeepSpeed facts both follow (deepspeed/runtime/fp16/onebit):
- The update is ``p -= lr * (exp_avg / (sqrt(exp_avg_sq) + eps) + weight_decay * p)``:
  decoupled weight decay, and no bias correction (DeepSpeed takes a
  ``bias_correction`` argument and never applies it).
- On some steps the optimizer, not the engine, averages over the ranks:
  it then steps on each rank's own gradient and sends 1-bit messages
  (zcore.comm.compressed_allreduce). ``takes_averaged_gradients()`` tells the
  engine, before each step's backward, which kind of step comes.
- ``exp_avg_mask`` in a parameter group multiplies the momentum after each
  compressed exchange (1-bit messages cannot carry exact zeros, so entries
  whose gradient is always zero would fill with error); a checkpoint never
  holds it: the group's current mask stays, as in DeepSpeed.

What a checkpoint holds is what DeepSpeed's load keeps: per parameter
``step`` (an int, as DeepSpeed's), ``exp_avg`` and ``exp_avg_sq``. Error
buffers, and 0/1 Adam's local-step buffers and interval counters, live
beside the state and start afresh after a load, as DeepSpeed resets them
(each rank's errors are its own, and meaningless at another world size).

DeepSpeed spends its first step setting up buffers: it updates nothing
there, yet counts it. zcore's first step is an ordinary one. Step numbers
(``freeze_step``, ``var_freeze_step``, the intervals) count optimizer
steps taken as DeepSpeed counts them, so each phase begins at the same
step number as in DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist

from zcore.comm import collectives as comm
from zcore.comm.compressed_allreduce import ErrorFeedback, compressed_all_reduce
from zcore.errors import InvalidArgumentError
from zcore.optim.functional import AdamConfig

# The parameter-group key of DeepSpeed's momentum mask.
MOMENTUM_MASK = "exp_avg_mask"

Entry = tuple[dict, torch.Tensor, dict]  # (group, parameter, its state) for one step


class CompressedAdam(torch.optim.Optimizer):
    """Base of :class:`zcore.optim.OneBitAdam` and :class:`zcore.optim.ZeroOneAdam`.

    Ranks are those of torch.distributed's default group (a world of one
    when it is not initialised: nothing is then compressed). Outside
    zcore's engine, average the gradients over the ranks yourself before
    exactly the steps for which ``takes_averaged_gradients()`` is True.
    """

    def __init__(
        self, params: Iterable[Any], lr: float, betas: tuple[float, float], eps: float, weight_decay: float
    ) -> None:
        AdamConfig(lr, tuple(betas), eps, weight_decay)  # torch's argument checks
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.steps_taken = 0  # optimizer steps, the count DeepSpeed's schedules follow
        self.errors: dict[torch.Tensor, ErrorFeedback] = {}  # per parameter, made at first use
        for index, group in enumerate(self.param_groups):
            _check_mask(group, index)

    # What the engine asks.
    def takes_averaged_gradients(self) -> bool:
        """Whether the coming step expects gradients averaged over the ranks
        (False: each rank's own; the step communicates itself)."""
        raise NotImplementedError

    def restart_from_loaded_state(self) -> None:
        """After a checkpoint load replaced ``state``: the step count follows
        the loaded states, errors (and the subclass's buffers and counters)
        start afresh, as DeepSpeed's load leaves them."""
        steps = [s["step"] for s in self.state.values() if "step" in s]
        self.steps_taken = max(steps, default=0)
        self.errors.clear()

    def held_tensors(self) -> list[torch.Tensor]:
        """What this optimizer keeps beside ``state`` (zcore.observe.memory_report
        counts it): each parameter's error feedback, made at its first
        compressed exchange and dropped by a checkpoint load."""
        return [t for error in self.errors.values() for t in (error.worker, error.server)]

    def compresses(self, group: dict) -> bool:
        """Whether the parameters of ``group`` go through the 1-bit
        all-reduce, so that they get error feedback."""
        return True

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The current momentum masks stay, whatever the saved groups hold (DeepSpeed's rule).
        groups = state_dict["param_groups"]
        for group, saved in zip(self.param_groups, groups):
            saved.pop(MOMENTUM_MASK, None)
            if MOMENTUM_MASK in group:
                saved[MOMENTUM_MASK] = group[MOMENTUM_MASK]
        super().load_state_dict(state_dict)
        self.restart_from_loaded_state()

    # For the subclasses' steps.
    @staticmethod
    def _call(closure: Optional[Callable[[], Any]]) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _entries(self) -> list[Entry]:
        """Every parameter with a gradient, its ``step`` counted: the same
        list, in the same order, on every rank (zcore's engine gives a
        parameter a gradient on all ranks or on none)."""
        entries = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise InvalidArgumentError(
                        f"{type(self).__name__} got a sparse gradient for a parameter of shape {tuple(p.shape)}; "
                        "it supports dense gradients only"
                    )
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                entries.append((group, p, state))
        return entries

    def _error_of(self, p: torch.Tensor) -> ErrorFeedback:
        error = self.errors.get(p)
        if error is None:
            error = self.errors[p] = ErrorFeedback.zeros(p.numel(), self.world_size, p.device)
        return error

    def _average_compressed(self, tensors: list[tuple[dict, torch.Tensor, torch.Tensor]]) -> None:
        """``(group, parameter, tensor)``: each tensor (shaped like its
        parameter) becomes its 1-bit mean over the ranks, then masked."""
        compressed_all_reduce([t.view(-1) for _, _, t in tensors], [self._error_of(p) for _, p, _ in tensors])
        for group, _, t in tensors:
            mask = group.get(MOMENTUM_MASK)
            if mask is not None:
                t.view(-1).mul_(mask.to(t.device).reshape(-1))

    def _average_exactly(self, grads: list[torch.Tensor]) -> None:
        """Gradients averaged over the ranks in place, uncompressed."""
        if self.world_size == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce_sum(flat)
        flat.mul_(1.0 / self.world_size)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    @staticmethod
    def _update(group: dict, p: torch.Tensor, state: dict) -> None:
        """``p -= lr * update``, by DeepSpeed's rule (above)."""
        update = state["exp_avg"] / state["exp_avg_sq"].sqrt().add_(group["eps"])
        if group["weight_decay"] > 0.0:
            update.add_(p, alpha=group["weight_decay"])
        p.add_(update, alpha=-group["lr"])


def _check_mask(group: dict, index: int) -> None:
    mask = group.get(MOMENTUM_MASK)
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise InvalidArgumentError(
            f"parameter group {index}: {MOMENTUM_MASK} must be a tensor of 0s and 1s, got {type(mask).__name__}"
        )
    for p in group["params"]:
        if p.numel() != mask.numel():
            raise InvalidArgumentError(
                f"parameter group {index}: {MOMENTUM_MASK} has shape {tuple(mask.shape)} but a parameter of the "
                f"group has shape {tuple(p.shape)}; a mask multiplies each parameter's momentum element by "
                "element: put each masked parameter in a group of its own, with a mask of its shape"
            )
