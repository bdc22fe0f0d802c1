"""The training engine: what ``zcore.initialize`` returns.

Shaped after DeepSpeed's engine: call it for the forward pass, then
``backward(loss)`` and ``step()`` for every micro-batch; it scales the loss
for accumulation (and fp16), and steps the optimizer only at accumulation
boundaries.
"""

from __future__ import annotations

import enum
import logging
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, TypeVar, Union

import torch
from torch.distributed.device_mesh import DeviceMesh

from zcore import checkpoint
from zcore.comm.collectives import DistributedContext
from zcore.config.schema import Config
from zcore.errors import DiskIOError, InvalidStateError
from zcore.observe.flops_profiler import FlopsProfiler, FlopsReport, ProfilerState
from zcore.step.grad_reduction import GradientReducer
from zcore.step.units import FlatUnit
from zcore.observe.memory_report import MemoryReport, measure_memory
from zcore.parallel.mesh import DataParallelRanks
from zcore.observe.monitors import close_all, open_monitors
from zcore.config.policies import Policies
from zcore.step.sharded_optimizer import Publisher, ShardedOptimizer, StepResult
from zcore.observe.step_metrics import Phase, StepMetrics, StepRecord

log = logging.getLogger("zcore")
# wall_clock_breakdown's lines: printed even where the application set up no logging.
step_log = logging.getLogger("zcore.steps")
T = TypeVar("T")


class ParamResidency(Protocol):
    """Where parameters live between uses: ``ResidentParams`` (stages 0-2)
    or zcore.zero3.param_fetcher.ParamFetcher (stage 3, gathered on demand)."""

    def forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any: ...

    def after_backward(self) -> None:
        """After the backward that may end a step."""

    def before_update(self) -> None:
        """Before the optimizer updates the parameters."""

    def abort(self) -> None:
        """After an exception in forward or backward."""

    def abort_after(self, exc: BaseException) -> None:
        """``abort``, whose own failure is noted on ``exc`` rather than raised."""

    def stats(self) -> Any: ...

    def stored_tensors(self) -> list[torch.Tensor]:
        """What holds parameters between uses (the memory report's parameter
        bytes in stages 0-2; in stage 3 it asks the fetcher, tier by tier)."""

    def reload(self) -> None:
        """After a checkpoint load replaced the shards: parameters take them."""

    def close(self) -> None:
        """Releases what parameters rest in outside memory (swap files)."""


class ResidentParams:
    """Stages 0-2: every rank holds whole parameters; nothing to do between uses."""

    def __init__(self, units: list[FlatUnit], publisher: Publisher) -> None:
        self.units = units
        self._publisher = publisher

    def reload(self) -> None:
        self._publisher.publish()

    def stored_tensors(self) -> list[torch.Tensor]:
        return [u.flat for u in self.units]

    def close(self) -> None:
        return None

    def forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        return module(*args, **kwargs)

    def after_backward(self) -> None:
        return None

    def before_update(self) -> None:
        return None

    def abort(self) -> None:
        return None

    def abort_after(self, exc: BaseException) -> None:
        return None

    def stats(self) -> None:
        return None


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int
    micro_batch_per_rank: int
    gradient_accumulation_steps: int


class MicroStep(enum.Enum):
    """Where the engine is in a micro-batch: backward, then step."""

    AWAITING_BACKWARD = "awaiting backward"  # step() now would count a micro-step with no gradients
    AWAITING_STEP = "awaiting step"  # this micro-batch's gradients are in


class Engine:
    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: Optional[ShardedOptimizer],
        lr_scheduler: Any,
        config: Config,
        policies: Policies,
        context: DistributedContext,
        batch: BatchSizes,
        residency: ParamResidency,
        hook_handles: list,
        ranks: DataParallelRanks,
    ) -> None:
        self.module = module
        self.ranks = ranks
        self.policies = policies
        self.residency = residency
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.config = config
        self.context = context
        self.batch = batch
        self._hook_handles = hook_handles
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.accumulated_micro_steps = 0  # since the last optimizer step: their gradients wait
        self.skipped_steps = 0
        self.last_grad_norm: Optional[float] = None
        self.micro_step_phase = MicroStep.AWAITING_BACKWARD
        self._boundary: Optional[bool] = None  # set_gradient_accumulation_boundary's, over the count
        # An optimizer step that failed part-way (a disk full during a
        # swap-out, say) left some shards updated and others not.
        self._broken: Optional[str] = None
        self._destroyed = False  # destroy() ran: swap files and buffers are gone
        # Frozen at initialize: zcore never trains them, so a gradient they
        # get (requires_grad set since) is reported once, not ignored silently.
        self._frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        self._unfrozen_reported = False
        # DeepSpeed's flops profiler, at one step (zcore.observe.flops_profiler).
        self.flops_profiler: Optional[FlopsProfiler] = None
        self.flops_report: Optional[FlopsReport] = None
        if config.flops_profiler.enabled:
            self.flops_profiler = FlopsProfiler(module, config.flops_profiler, context.rank, context.world_size)
        # Per-step metrics (zcore.observe.step_metrics), only when a monitor or
        # wall_clock_breakdown asks for them.
        self.metrics: Optional[StepMetrics] = None
        self.monitors: list = []
        if config.records_step_metrics:
            self.metrics = StepMetrics(module, context.world_size, ranks.data_parallel.size)
            self.monitors = open_monitors(config, context.rank)
            if optimizer is not None:
                optimizer.measures_norm = True
            if config.wall_clock_breakdown and not step_log.hasHandlers():
                handler = logging.StreamHandler(sys.stderr)
                handler.setFormatter(logging.Formatter("[zcore] %(message)s"))
                step_log.addHandler(handler)
                step_log.setLevel(logging.INFO)

    def __getattr__(self, name: str) -> Any:
        # Reached only for names the engine lacks: as DeepSpeed's engine does,
        # they are the wrapped module's (engine.config of a Hugging Face
        # model is zcore's config, though: the engine's own names come first).
        module = self.__dict__.get("module")
        if module is not None and name != "module":
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(
            f"'{type(self).__name__}' object has no attribute {name!r}, and neither has the module it "
            f"wraps ({type(module).__name__})"
        )

    # Forward.
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_if_broken()
        profiler = self.flops_profiler
        if profiler is not None and profiler.state is ProfilerState.WAITING and profiler.profiles(self.global_steps):
            profiler.start()
        if self.metrics is not None:
            self.metrics.forward_inputs(args, kwargs)
        try:
            with self._phase(Phase.FORWARD):
                out = self.residency.forward(self.module, args, kwargs)
        except DiskIOError as exc:
            self._broken = f"the forward after step {self.global_steps} failed ({type(exc).__name__}: {exc})"
            raise
        if self.optimizer is not None and self.optimizer.step_failed:
            self._finish_step()  # raises the failure of the step behind this forward
        return out

    forward = __call__

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    # Backward and step.
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.batch.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """As DeepSpeed's: whether the coming micro-steps end an accumulation,
        decided by the caller instead of counted (a loop whose last
        accumulation of an epoch is shorter: transformers' Trainer). Set it
        before each micro-step's backward."""
        self._boundary = bool(is_boundary)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Back-propagates ``loss`` scaled for accumulation (unless
        ``scale_wrt_gas`` is False: the caller scaled it, as DeepSpeed's
        argument says) and by the fp16 loss scale; gradients are reduced
        across ranks as backward produces them."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                f"engine.backward expects a scalar loss tensor, got "
                f"{type(loss).__name__} of shape {tuple(getattr(loss, 'shape', ()))}"
            )
        self._refuse_if_broken()
        optimizer = self._trainer("backward")
        if self.metrics is not None:
            self.metrics.loss(loss)
        factor = optimizer.loss_scale / (self.batch.gradient_accumulation_steps if scale_wrt_gas else 1)
        with self._phase(Phase.BACKWARD):
            self._backward(optimizer, lambda: (loss * factor if factor != 1.0 else loss).backward())
        self.micro_step_phase = MicroStep.AWAITING_STEP
        return loss

    def pipeline_backward(self, run: Callable[[float], T], boundary: bool, loss: Optional[torch.Tensor]) -> T:
        """One micro-batch's backward as a pipeline schedule runs it
        (zcore.parallel.pipelining): ``run(factor)`` back-propagates with the loss
        scaled by ``factor`` (the loss scale over the accumulation steps);
        ``boundary``: whether it ends the accumulation window (the schedule
        decides, as set_gradient_accumulation_boundary does); ``loss``: the
        micro-batch's loss on the last stage, for the step's record. Call
        ``step()`` after it, as after ``backward``."""
        self._refuse_if_broken()
        optimizer = self._trainer("backward")
        if self.metrics is not None and loss is not None:
            self.metrics.loss(loss)
        factor = optimizer.loss_scale / self.batch.gradient_accumulation_steps
        self.set_gradient_accumulation_boundary(boundary)
        with self._phase(Phase.BACKWARD):
            # The window's forwards and backwards interleave (1F1B, GPipe):
            # ZeRO-3's step spans them all, so it ends with the last backward.
            result = self._backward(optimizer, lambda: run(factor), end_step=boundary)
        self.micro_step_phase = MicroStep.AWAITING_STEP
        return result

    def _backward(self, optimizer: ShardedOptimizer, run: Callable[[], T], end_step: bool = True) -> T:
        self._finish_step()
        reducer = optimizer.reducer
        reducer.begin_micro_step(self.is_gradient_accumulation_boundary())
        try:
            result = run()
            if end_step:
                self.residency.after_backward()
            reducer.end_backward()
        except BaseException as exc:
            self._abort_backward(reducer, exc)
            raise
        return result

    def _abort_backward(self, reducer: GradientReducer, exc: BaseException) -> None:
        """A backward raised ``exc``: its gathers end, and the accumulation
        window's gradients are dropped (some of this micro-batch's were
        reduced, others not), so that training can go on from the next
        micro-batch. A disk error breaks the engine instead (what reached
        the disk is unknown)."""
        self.residency.abort_after(exc)
        cause = exc if isinstance(exc, DiskIOError) else None
        try:
            reducer.discard_window()
        except BaseException as failed:  # noqa: BLE001 - noted on exc, the error the caller sees
            exc.add_note(f"dropping the window's gradients then failed too: {type(failed).__name__}: {failed}")
            cause = cause or failed
        if cause is not None:
            self._broken = f"the backward after step {self.global_steps} failed ({type(cause).__name__}: {cause})"
            return
        dropped = self.accumulated_micro_steps
        if self.metrics is not None:
            self.metrics.drop_losses()
        self.micro_steps -= dropped
        self.accumulated_micro_steps = 0
        self.micro_step_phase = MicroStep.AWAITING_BACKWARD
        earlier = f" and of the {dropped} before it in its accumulation window" if dropped else ""
        log.warning(
            "backward raised %s: the gradients of this micro-batch%s are dropped; the next backward "
            "starts the window again", type(exc).__name__, earlier,
        )

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        """Steps the optimizer at an accumulation boundary; counts the
        micro-step. ``lr_kwargs``: as DeepSpeed's, passed to the scheduler's
        step (ReduceLROnPlateau's ``metrics``)."""
        self._refuse_if_broken()
        optimizer = self._trainer("step")
        if self.micro_step_phase is not MicroStep.AWAITING_STEP:
            raise InvalidStateError(
                "engine.step() was called without engine.backward(loss) since the last step, which "
                "would count a micro-step that has no gradients; call engine.backward(loss) first "
                "(every micro-batch: forward, backward, step)"
            )
        stepped = self.is_gradient_accumulation_boundary()
        if stepped:
            self._report_unfrozen()
            groups = optimizer.param_groups
            lr = groups[0]["lr"] if groups else None  # the step's, before the scheduler moves it
            profiling = self.flops_profiler is not None and self.flops_profiler.state is ProfilerState.PROFILING
            started = time.perf_counter()
            with self._phase(Phase.STEP):
                self._finish_step()
                self.residency.before_update()
                try:
                    result = optimizer.step()
                except BaseException as exc:
                    self._broken = (
                        f"the optimizer step after step {self.global_steps} failed ({type(exc).__name__}: {exc})"
                    )
                    raise
                if profiling:
                    self._finish_step()  # the profiled step's latency is all of it, not its launch
            step_seconds = time.perf_counter() - started
            self.last_grad_norm = result.grad_norm
            if result.skipped:
                self.skipped_steps += 1
                log.info(
                    "step %d skipped: gradient overflow; loss scale now %g",
                    self.global_steps,
                    optimizer.loss_scale,
                )
            self.global_steps += 1
            self.global_samples += self.batch.train_batch_size
            self.accumulated_micro_steps = 0
            if self.metrics is not None:
                self._record_step(optimizer, result, lr)
            if profiling:
                assert self.flops_profiler is not None
                self.flops_report = self.flops_profiler.stop(step_seconds=step_seconds)
            if self.context.rank == 0 and self.global_steps % self.config.steps_per_print == 0:
                log.info(
                    "step %d: lr %s, loss scale %g, skipped %d",
                    self.global_steps,
                    self.get_lr(),
                    optimizer.loss_scale,
                    self.skipped_steps,
                )
        else:
            self.accumulated_micro_steps += 1
        self.micro_steps += 1
        self.micro_step_phase = MicroStep.AWAITING_BACKWARD
        # Last: a scheduler that raises (ReduceLROnPlateau without its
        # metrics) finds the step taken and counted, not half done.
        if stepped and not result.skipped and self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))

    def _report_unfrozen(self) -> None:
        if self._unfrozen_reported:
            return
        unfrozen = [n for n, p in self._frozen if p.grad is not None]
        if unfrozen:
            self._unfrozen_reported = True
            log.warning(
                "parameters frozen at zcore.initialize got gradients and are not trained: %s. zcore trains "
                "the parameters that require grad at initialize; set requires_grad before it to train these",
                ", ".join(unfrozen[:8]) + (" ..." if len(unfrozen) > 8 else ""),
            )

    def _phase(self, phase: Phase) -> Any:
        return self.metrics.phase(phase) if self.metrics is not None else nullcontext()

    def _record_step(self, optimizer: ShardedOptimizer, result: StepResult, lr: Optional[float]) -> None:
        assert self.metrics is not None
        record = self.metrics.end_step(
            global_step=self.global_steps,
            global_samples=self.global_samples,
            batch_size=self.batch.train_batch_size,
            lr=lr,
            grad_norm=result.grad_norm,
            loss_scale=optimizer.loss_scale,
            skipped=result.skipped,
            skipped_steps=self.skipped_steps,
            memory=measure_memory(self.module, optimizer, self.policies, self.residency, self.context.device),
        )
        events = record.events()
        for monitor in self.monitors:
            monitor.write(events)
        if self.config.wall_clock_breakdown and self.context.rank == 0:
            if self.global_steps % self.config.steps_per_print == 0:
                step_log.info("step %d: %s", self.global_steps, record.breakdown())

    @property
    def last_step_metrics(self) -> Optional[StepRecord]:
        """The last optimizer step's figures (zcore.observe.step_metrics), when the
        config enables a monitor or wall_clock_breakdown; else None."""
        return None if self.metrics is None else self.metrics.last

    def _trainer(self, doing: str) -> ShardedOptimizer:
        if self.optimizer is None:
            raise InvalidStateError(
                f"engine.{doing}: this engine has no optimizer (zcore.initialize got none and the config "
                "has no 'optimizer' section), so it runs forward passes and generation only; give "
                "zcore.initialize an optimizer to train"
            )
        return self.optimizer

    def _finish_step(self) -> None:
        """An optimizer step going on behind the forward (zcore.step.background_step)
        completes first; its failure breaks the engine."""
        if self.optimizer is None:
            return
        try:
            self.optimizer.finish_step()
        except BaseException as exc:
            if self._broken is None:
                self._broken = (
                    f"the optimizer step after step {self.global_steps - 1} failed while the next forward "
                    f"ran ({type(exc).__name__}: {exc})"
                )
            raise

    def _refuse_if_destroyed(self) -> None:
        if self._destroyed:
            raise InvalidStateError(
                "this engine was destroyed: engine.destroy() removed its swap files and released its "
                "buffers. Build a new engine with zcore.initialize (and load a checkpoint to go on)"
            )

    def _refuse_if_broken(self) -> None:
        self._refuse_if_destroyed()
        if self._broken is not None:
            raise InvalidStateError(
                f"this engine cannot continue: {self._broken[:2000]}, so its parameters and optimizer "
                "states are partly updated. Remove the cause, then load the last checkpoint into a "
                "new engine"
            )

    def zero_grad(self) -> None:
        """Gradients live in zcore's buffers and are cleared after each step;
        this clears any ``.grad`` left on the module's parameters."""
        for p in self.module.parameters():
            p.grad = None

    # What DeepSpeed users query.
    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self._trainer("get_lr").param_groups]

    @property
    def loss_scale(self) -> float:
        return self._trainer("loss_scale").loss_scale

    @property
    def zero_stage(self) -> int:
        return self.policies.stage.stage

    @property
    def device_mesh(self) -> Optional[DeviceMesh]:
        """The nodes x ranks mesh hpZ, MiCS and qgZ use (the one given to
        zcore.initialize, or built from LOCAL_WORLD_SIZE), or the "dp" x "tp"
        mesh given (zcore.parallel.mesh); None where no feature needed one."""
        if self.ranks.model_parallel is not None:
            return self.ranks.model_parallel.mesh
        topology = self.ranks.topology
        return topology.mesh if topology is not None else None

    def train_batch_size(self) -> int:
        return self.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch.micro_batch_per_rank

    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps

    def gather_stats(self) -> Any:
        """Stage 3: zcore.zero3.param_fetcher.GatherStats (gathers, prefetch hits and
        misses, peak live elements, arena fallbacks, ...); None otherwise."""
        return self.residency.stats()

    def destroy(self) -> None:
        """Waits for pending writes and removes this rank's swap files
        (parameters and optimizer states on NVMe are then gone); the engine
        cannot train after it. Also done when the process exits."""
        if self._destroyed:
            return
        self._destroyed = True
        try:
            if self._broken is None:  # else its failure was raised already
                self._finish_step()
        finally:
            try:
                self.residency.close()
            finally:
                try:
                    if self.optimizer is not None:
                        self.optimizer.close()
                finally:
                    if self.flops_profiler is not None:
                        self.flops_profiler.close()
                    close_all(self.monitors)
                    self.monitors = []

    # Checkpoints (zcore.checkpoint).
    def save_checkpoint(
        self, save_dir: Union[str, Path], tag: Optional[str] = None, client_state: Any = None
    ) -> Path:
        """Every rank writes its ranges of the fp32 weights and optimizer
        states (safetensors) beside JSON metadata; ``tag`` defaults to
        ``global_step{N}``; ``save_dir/latest`` then names it. Call it on
        every rank, at an accumulation boundary. Returns the tag directory."""
        self._refuse_if_broken()
        self._trainer("save_checkpoint")
        self._finish_step()
        return checkpoint.save_checkpoint(self, save_dir, tag, client_state)

    def load_checkpoint(
        self,
        load_dir: Union[str, Path],
        tag: Optional[str] = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[Optional[Path], Any]:
        """Loads a checkpoint saved at any world size, stage or offload
        setting (the tag in ``load_dir/latest`` by default). Returns (tag
        directory, client_state), or (None, None) when there is no latest."""
        self._refuse_if_destroyed()
        try:
            self._finish_step()
        except Exception:  # noqa: BLE001 - the engine is broken (self._broken) until a full load below
            pass
        loaded = checkpoint.load_checkpoint(
            self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only
        )
        if loaded[0] is not None and not load_module_only and load_optimizer_states:
            self._broken = None  # every state was replaced
            if self.optimizer is not None:
                self.optimizer.forget_failed_step()
        return loaded

    def restore_counters(self, counters: checkpoint.schema.Counters) -> None:
        """The step counters of a loaded checkpoint, from its validated record."""
        self.global_steps = counters.global_steps
        self.global_samples = counters.global_samples
        self.micro_steps = counters.micro_steps
        self.skipped_steps = counters.skipped_steps
        self.accumulated_micro_steps = 0
        self.micro_step_phase = MicroStep.AWAITING_BACKWARD

    def full_state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The whole model's state dict (fp32 master weights, frozen
        parameters, buffers) on rank 0, gathered one unit at a time; an
        empty dict on the other ranks. Call it on every rank."""
        self._refuse_if_destroyed()
        self._finish_step()
        return checkpoint.full_state_dict(self, dtype)

    def memory_report(self) -> MemoryReport:
        """Bytes per rank held for parameters, gradients, optimizer states and
        buffers on each tier (device, host, NVMe): measured, beside what the
        stage's layout and the offload policy predict."""
        self._refuse_if_destroyed()
        self._finish_step()
        return measure_memory(self.module, self.optimizer, self.policies, self.residency, self.context.device)
