"""DeepSpeed's engine surface over zcore's parts: the attributes and methods
of DeepSpeed's ``DeepSpeedEngine`` (runtime/engine.py, 0.19) that its
examples and the Hugging Face, Accelerate and Lightning integrations call,
with DeepSpeed's meaning, answered from what the engine holds (its config,
policies, ranks, counters and optimizer).

The names zcore does not honour are refused by name (``refusal``): the
engine raises an AttributeError that says what zcore does instead, so that
``hasattr`` is False for them, as integrations that probe for a method expect.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch

from zcore import checkpoint
from zcore.checkpoint.model_file import save_model_file
from zcore.errors import InvalidArgumentError
from zcore.step.precision import precision_from_config

if TYPE_CHECKING:
    from zcore.checkpoint.async_save import AsyncCheckpointer
    from zcore.comm.collectives import DistributedContext
    from zcore.config.policies import Policies
    from zcore.config.schema import Config
    from zcore.engine.lifetime import Lifetime
    from zcore.engine.rank_calls import EngineCalls
    from zcore.engine.residency import ParamResidency
    from zcore.parallel.mesh import DataParallelRanks
    from zcore.step.sharded_optimizer import ShardedOptimizer

# DeepSpeed engine names zcore does not provide: what zcore does instead.
REFUSED: dict[str, str] = {
    "coalesce_grad_reduction": (
        "zcore reduces an accumulation window's gradients once, at its last backward, at stages 0-1 (at "
        "stages 2-3 each micro-step's, keeping only shards); call engine.backward(loss) and engine.step() "
        "for each micro-batch"
    ),
    "scale": (
        "zcore scales the loss inside engine.backward(loss), which also runs its gradient reduction around "
        "the backward (a bare loss.backward() would bypass it); pass scale_wrt_gas=False for a loss you "
        "already divided by the accumulation steps"
    ),
    "offload_states": (
        "zcore keeps parameters and optimizer states where the config's offload_param and offload_optimizer "
        "sections place them, for the engine's whole life"
    ),
    "reload_states": "zcore never moves states out at run time (see offload_states), so there is nothing to reload",
    "module_state_dict": (
        "use engine.full_state_dict() (the whole model on rank 0, gathered one unit at a time) or "
        "engine.save_16bit_model(save_dir)"
    ),
    "training_dataloader": "zcore.initialize returns the data loader (its third value); the engine keeps none",
    "deepspeed_io": (
        "zcore.initialize(training_data=...) builds the training loader; build others with torch's "
        "DataLoader and a DistributedSampler over engine.dp_world_size ranks"
    ),
    "set_train_batch_size": "the batch sizes are the config's, fixed at zcore.initialize: build a new engine",
    "set_train_micro_batch_size": "the batch sizes are the config's, fixed at zcore.initialize: build a new engine",
}


def refusal(name: str) -> Optional[str]:
    """The message of the AttributeError for a DeepSpeed engine name zcore
    does not provide; None for any other name."""
    reason = REFUSED.get(name)
    if reason is None:
        return None
    return f"engine.{name} is DeepSpeed's, which zcore does not provide: {reason}"


def _check_save_options(save_latest: bool, exclude_frozen_parameters: bool) -> None:
    """DeepSpeed's save_checkpoint options. ``exclude_frozen_parameters``
    is accepted: zcore writes frozen parameters all the same (they cost disk
    only, and a load restores the values they keep)."""
    if not save_latest:
        raise InvalidArgumentError(
            "save_checkpoint(save_latest=False) is DeepSpeed's, which zcore does not provide: zcore's checkpoint "
            "always names its tag in save_dir/latest, written last; load another tag with "
            "load_checkpoint(load_dir, tag=...)",
            argument="save_latest",
        )


def _check_load_options(load_module_strict: bool, custom_load_fn: Any) -> None:
    """DeepSpeed's load_checkpoint options zcore cannot honour, refused by name."""
    if not load_module_strict:
        raise InvalidArgumentError(
            "load_checkpoint(load_module_strict=False) is DeepSpeed's, which zcore does not provide: a zcore "
            "checkpoint loads only into a model with the same tensors (a CheckpointMismatchError names any "
            "other); to load the weights that match, turn the checkpoint into a weights directory with "
            "`zcore consolidate`, then call zcore.load_pretrained(engine, directory, strict=False)",
            argument="load_module_strict",
        )
    if custom_load_fn is not None:
        raise InvalidArgumentError(
            "load_checkpoint(custom_load_fn=...) is DeepSpeed's, which zcore does not provide: zcore reads each "
            "rank's ranges of the saved tensors itself; change the weights after the load instead",
            argument="custom_load_fn",
        )


class LossScale(float):
    """The current loss scale, a number (as ``engine.loss_scale`` always was
    in zcore). DeepSpeed's engine has ``loss_scale()``, a method returning
    the configured fp16.loss_scale: calling this number says so."""

    def __call__(self) -> float:
        raise TypeError(
            "engine.loss_scale is zcore's current loss scale, a number (no call); DeepSpeed's method "
            "engine.loss_scale() returns the configured fp16.loss_scale (0: dynamic), which is "
            "engine.config.fp16.loss_scale here"
        )


class DeepSpeedEngineNames:
    """DeepSpeed's names for what the engine knows (zcore.engine.engine.Engine
    inherits them): ranks and device, batch sizes, the ZeRO stage and
    precision, the optimizer's learning rates, the last step's outcome, and
    the 16-bit weights of the whole model."""

    # Set by the engine.
    module: torch.nn.Module
    optimizer: Optional[ShardedOptimizer]
    config: Config
    context: DistributedContext
    policies: Policies
    ranks: DataParallelRanks
    residency: ParamResidency
    lifetime: Lifetime
    checkpoints: AsyncCheckpointer
    calls: EngineCalls
    batch: Any  # zcore.engine.engine.BatchSizes
    last_grad_norm: Optional[float]
    last_step_applied: bool

    def _trainer(self, doing: str) -> ShardedOptimizer:
        raise NotImplementedError  # the engine's: its optimizer, or an error naming ``doing``

    def _finish_step(self) -> None:
        raise NotImplementedError  # the engine's: a step behind the forward completes

    # Ranks and device, as DeepSpeed's engine sets them at construction.
    @property
    def local_rank(self) -> int:
        """This rank's index on its node (LOCAL_RANK; 0 without a launcher):
        its GPU's index on CUDA."""
        return self.context.local_rank

    @property
    def global_rank(self) -> int:
        return self.context.rank

    @property
    def world_size(self) -> int:
        return self.context.world_size

    @property
    def device(self) -> torch.device:
        """Where this rank computes: its GPU, or the CPU. Inputs go there."""
        return self.context.device

    @property
    def dp_world_size(self) -> int:
        """The data-parallel ranks (the world, or a mesh's "dp" dimension)."""
        return self.ranks.data_parallel.size

    @property
    def mp_world_size(self) -> int:
        """The tensor-parallel ranks of a "dp" x "tp" mesh; 1 without one."""
        mesh = self.ranks.model_parallel
        return 1 if mesh is None else mesh.tp_size

    def get_data_parallel_rank(self) -> int:
        return self.ranks.data_parallel.rank

    def get_model_parallel_rank(self) -> int:
        mesh = self.ranks.model_parallel
        return 0 if mesh is None else mesh.tp_rank

    get_tensor_parallel_rank = get_model_parallel_rank

    # Batch sizes.
    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch on each rank."""
        return self.batch.micro_batch_per_rank

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.batch.gradient_accumulation_steps

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu,
        gradient_accumulation_steps), the numbers DeepSpeed's docstring
        promises (its code returns the three methods themselves)."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    # The config's answers.
    @property
    def zero_stage(self) -> int:
        return self.policies.stage.stage

    def zero_optimization_stage(self) -> int:
        return self.zero_stage

    def zero_optimization(self) -> bool:
        """Whether ZeRO is on (stage 1 or above)."""
        return self.zero_stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_stage == 3

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """True: save_16bit_model always writes the whole model's weights, at
        every stage, streamed (DeepSpeed's stage 3 does only when
        stage3_gather_16bit_weights_on_model_save is set)."""
        return True

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def gradient_clipping(self) -> float:
        """The global norm gradients are clipped to (0: no clipping)."""
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    # The optimizer and the last step.
    def get_lr(self) -> list[float]:
        """Each parameter group's learning rate."""
        return [group["lr"] for group in self._trainer("get_lr").param_groups]

    def get_mom(self) -> list[Any]:
        """Each parameter group's ``betas`` (Adam-like), else its ``momentum``
        (SGD, RMSprop), else 0.0, as DeepSpeed reads them."""
        groups = self._trainer("get_mom").param_groups
        return [g["betas"] if "betas" in g else g.get("momentum", 0.0) for g in groups]

    @property
    def loss_scale(self) -> LossScale:
        """The current loss scale (fp16's dynamic scale; 1.0 otherwise)."""
        return LossScale(self._trainer("loss_scale").loss_scale)

    def get_global_grad_norm(self) -> Optional[float]:
        """The global norm of the last optimizer step's gradients (unscaled,
        before clipping); None before the first step, or where the step
        did not measure it (no gradient_clipping, no fp16, no step metrics)."""
        return self.last_grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the parameters: False inside an
        accumulation window, or when an fp16 overflow skipped it."""
        return self.last_step_applied

    def zero_grad(self) -> None:
        """Gradients live in zcore's buffers and are cleared after each step;
        this clears any ``.grad`` left on the module's parameters."""
        for p in self.module.parameters():
            p.grad = None

    # Modes and memory.
    def train(self, mode: bool = True) -> Any:
        """Sets the module's training mode, as ``torch.nn.Module.train``."""
        self.module.train(mode)
        return self

    def eval(self) -> Any:
        """``train(False)``."""
        return self.train(False)

    def empty_partition_cache(self) -> None:
        """Stage 3: releases the gathered copies of parameters a forward left
        (one whose outputs still await their backward keeps them), and the
        device's cached blocks; parameters kept gathered by
        stage3_param_persistence_threshold stay, as in DeepSpeed. Call it on
        every rank."""
        self.lifetime.check_not_destroyed()
        self._finish_step()
        self.residency.after_backward()  # ends the ZeRO-3 step when no forward awaits its backward
        gc.collect()
        if self.context.device.type == "cuda":
            torch.cuda.empty_cache()

    # Checkpoints (zcore.checkpoint), with DeepSpeed's arguments.
    def save_checkpoint(
        self, save_dir: Union[str, Path], tag: Optional[str] = None, client_state: Any = None,
        save_latest: bool = True, exclude_frozen_parameters: bool = False, *, async_save: Optional[bool] = None,
    ) -> Path:
        """Every rank writes its ranges of the fp32 weights and optimizer
        states (safetensors) beside JSON metadata; ``tag`` defaults to
        ``global_step{N}``; ``save_dir/latest`` then names it. Call it on
        every rank, at an accumulation boundary. Returns the tag directory.
        ``async_save`` (default: the config's checkpoint.async_save): copy
        the state to host memory, return, and write in the background
        (zcore.checkpoint.async_save); ``wait_for_checkpoint()`` waits for
        it. Either way, a save in progress is waited for first, and its
        failure raised. DeepSpeed's ``save_latest`` and
        ``exclude_frozen_parameters``: as ``_check_save_options`` says."""
        _check_save_options(save_latest, exclude_frozen_parameters)
        self.lifetime.check_usable()
        self.calls.settle()  # a rank whose last call raised: the save's collectives only if every rank's did
        self._trainer("save_checkpoint").check_saveable()
        self._finish_step()
        self.checkpoints.wait()
        background = self.config.checkpoint.async_save if async_save is None else async_save
        if background:
            return self.checkpoints.save(self, save_dir, tag, client_state)
        return checkpoint.save_checkpoint(self, save_dir, tag, client_state)

    def load_checkpoint(
        self,
        load_dir: Union[str, Path],
        tag: Optional[str] = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Optional[Callable] = None,
    ) -> tuple[Optional[Path], Any]:
        """Loads a checkpoint saved at any world size, stage or offload
        setting (the tag in ``load_dir/latest`` by default). Returns (tag
        directory, client_state), or (None, None) when there is no latest.
        DeepSpeed's arguments, in its order; ``load_module_strict`` and
        ``custom_load_fn`` as ``_check_load_options`` says."""
        _check_load_options(load_module_strict, custom_load_fn)
        self.lifetime.check_not_destroyed()
        self.checkpoints.wait()  # the save in progress may be the one to load, and its staging is not abandoned
        try:
            self._finish_step()
        except Exception:  # noqa: BLE001 - the engine is broken (self.lifetime) until a full load below
            pass
        loaded = checkpoint.load_checkpoint(
            self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only
        )
        if loaded[0] is not None and not load_module_only and load_optimizer_states:
            self.lifetime.recover()  # every state was replaced
            if self.optimizer is not None:
                self.optimizer.forget_failed_step()
        return loaded

    # Weights.
    def save_16bit_model(
        self, save_dir: Union[str, Path], save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Writes the whole model's weights in the dtype it computes in (bf16
        or fp16; fp32 without mixed precision, as DeepSpeed) to
        ``save_dir/save_filename`` on rank 0: a torch file that
        ``torch.load`` reads, or a safetensors file for a name ending in
        ``.safetensors``. Gathered one unit at a time from the fp32 master
        weights and written as each arrives: no rank holds the whole model.
        Call it on every rank. Returns True, as DeepSpeed does once saved."""
        if not save_filename or Path(save_filename).name != save_filename:
            raise InvalidArgumentError(
                f"save_16bit_model(save_filename={save_filename!r}) must be a file name, without a directory",
                argument="save_filename",
            )
        self.lifetime.check_usable()
        self._finish_step()
        save_model_file(self, Path(save_dir) / save_filename, self._compute_dtype(), exclude_frozen_parameters)
        return True

    def save_fp16_model(self, save_dir: Union[str, Path], save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's former name of ``save_16bit_model``."""
        return self.save_16bit_model(save_dir, save_filename)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> Optional[dict]:
        """The whole model's state dict in its compute dtype on rank 0 (None
        on the others), gathered one unit at a time: the private DeepSpeed
        method Accelerate and transformers call to save 16-bit weights.
        zcore answers at every stage. Call it on every rank."""
        self.lifetime.check_not_destroyed()
        self._finish_step()
        state = checkpoint.full_state_dict(self, self._compute_dtype())
        if self.context.rank != 0:
            return None
        if exclude_frozen_parameters:
            frozen = {name for name, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def _compute_dtype(self) -> torch.dtype:
        return precision_from_config(self.config).compute_dtype
