"""The training engine: what ``zcore.initialize`` returns.

Shaped after DeepSpeed's engine: call it for the forward pass, then
``backward(loss)`` and ``step()`` for every micro-batch; it scales the loss
for accumulation (and fp16), and steps the optimizer only at accumulation
boundaries.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch
from torch.distributed.device_mesh import DeviceMesh

from zcore import checkpoint
from zcore.checkpoint.async_save import AsyncCheckpointer
from zcore.comm.collectives import DistributedContext
from zcore.config.policies import Policies
from zcore.config.schema import Config
from zcore.engine.compiled_units import CompiledUnits, check_compile_options, compile_blocks, has_compiled
from zcore.engine.deepspeed_names import DeepSpeedEngineNames, refusal
from zcore.engine.frozen import FrozenParameters
from zcore.engine.lifetime import Lifetime
from zcore.engine.observation import StepFigures, StepObservation
from zcore.engine.rank_calls import EngineCalls
from zcore.engine.residency import ParamResidency
from zcore.errors import DiskIOError, InvalidStateError
from zcore.observe.flops_profiler import FlopsReport
from zcore.observe.memory_report import MemoryReport, measure_memory
from zcore.observe.step_metrics import Phase, StepRecord
from zcore.parallel.mesh import DataParallelRanks
from zcore.step.grad_reduction import GradientReducer
from zcore.step.sharded_optimizer import ShardedOptimizer
from zcore.zero3.param_fetcher import ParamFetcher

log = logging.getLogger("zcore")
T = TypeVar("T")


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int
    micro_batch_per_rank: int
    gradient_accumulation_steps: int


class MicroStep(enum.Enum):
    """Where the engine is in a micro-batch: backward, then step."""

    AWAITING_BACKWARD = "awaiting backward"  # step() now would count a micro-step with no gradients
    AWAITING_STEP = "awaiting step"  # this micro-batch's gradients are in


@dataclass(frozen=True)
class EngineParts:
    """What ``zcore.initialize`` assembles for an engine beside its module,
    optimizer and scheduler."""

    policies: Policies
    context: DistributedContext
    batch: BatchSizes
    residency: ParamResidency
    observation: StepObservation
    hook_handles: list
    ranks: DataParallelRanks


class Engine(DeepSpeedEngineNames):
    """What ``zcore.initialize`` returns. It delegates to parts with one job
    each: ``residency`` (where parameters live between uses), ``optimizer``
    (the sharded step), ``observation`` (metrics, monitors, profiler, step
    log) and ``lifetime`` (whether it can still be used); it keeps the step
    counters and the order of forward, backward and step. DeepSpeed's
    names for what it knows (``local_rank``, ``get_lr()``,
    ``save_16bit_model``, ...) come from zcore.engine.deepspeed_names."""

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: Optional[ShardedOptimizer],
        lr_scheduler: Any,
        config: Config,
        parts: EngineParts,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.config = config  # as DeepSpeed's engine.config: what it was built from, recorded in checkpoints
        self.ranks = parts.ranks
        self.policies = parts.policies
        self.residency = parts.residency
        self.context = parts.context
        self.batch = parts.batch
        self.observation = parts.observation
        self.lifetime = Lifetime()
        self.checkpoints = AsyncCheckpointer()  # saves written in the background (zcore.checkpoint.async_save)
        check = config.out_of_step_check
        # Whether the ranks make their calls in step (note "ranks out of step" there).
        self.calls = EngineCalls(parts.ranks.data_parallel, check.enabled, check.patience_seconds, self._out_of_step)
        self._hook_handles = parts.hook_handles
        # Stage 3: compiled modules are gathered as units (note "compiled units").
        self._units = (
            CompiledUnits(module, parts.residency, self._hook_handles)
            if isinstance(parts.residency, ParamFetcher) else None
        )
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.accumulated_micro_steps = 0  # since the last optimizer step: their gradients wait
        self.skipped_steps = 0
        self.last_grad_norm: Optional[float] = None
        self.last_step_applied = False  # whether the last step() updated the parameters
        self.micro_step_phase = MicroStep.AWAITING_BACKWARD
        self._boundary: Optional[bool] = None  # set_gradient_accumulation_boundary's, over the count
        self._no_sync = False  # inside no_sync(): backward passes end no window
        self._frozen = FrozenParameters(module)
        if optimizer is not None and self.observation.records_steps:
            optimizer.measures_norm = True

    def __getattr__(self, name: str) -> Any:
        # Reached only for names the engine lacks: as DeepSpeed's engine does,
        # they are the wrapped module's (engine.config of a Hugging Face
        # model is zcore's config, though: the engine's own names come first),
        # except DeepSpeed's engine names zcore refuses, which say why.
        refused = refusal(name)
        if refused is not None:
            raise AttributeError(refused)
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
        self.lifetime.check_usable()
        # A forward without gradients at stages 0-2 starts no collective: one rank may run it alone.
        counted = torch.is_grad_enabled() or self.policies.stage.shards_parameters
        with self.calls.call(Phase.FORWARD.value, self.micro_steps, counted):
            self.observation.before_forward(self.global_steps, args, kwargs)
            if self._units is not None:
                self._units.adopt()
            try:
                with self.observation.phase(Phase.FORWARD):
                    out = self.residency.forward(self.module, args, kwargs)
            except DiskIOError as exc:
                self.lifetime.break_because(
                    f"the forward after step {self.global_steps} failed ({type(exc).__name__}: {exc})"
                )
                raise
            if self.optimizer is not None and self.optimizer.step_failed:
                self._finish_step()  # raises the failure of the step behind this forward
        return out

    forward = __call__

    def compile(self, backend: Any = "inductor", compile_kwargs: Optional[dict] = None) -> None:
        """DeepSpeed's ``engine.compile``: torch.compile with ``backend`` and
        ``compile_kwargs``. Stages 0-2 compile the whole model; stage 3
        compiles each of its blocks (the modules of its nn.ModuleList),
        gathered as one unit each (note "compiled units" in
        zcore.engine.compiled_units)."""
        options = dict(compile_kwargs or {})
        if self._units is None:
            self.module.compile(backend=backend, **options)
            return
        check_compile_options(backend, options)
        compile_blocks(self.module, lambda block: block.compile(backend=backend, **options), "engine.compile()")

    @property
    def is_compiled(self) -> bool:
        """As DeepSpeed's: whether the model, or modules inside it, run compiled."""
        return has_compiled(self.module)

    # Backward and step.
    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the coming backward ends an accumulation window (its step updates)."""
        if self._no_sync:
            return False
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.batch.gradient_accumulation_steps == 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """A block whose backward passes end no accumulation window, as
        DeepSpeed's and DDP's ``no_sync``: at stages 0-1 they sum this rank's
        gradients without reducing them (DeepSpeed's meaning), at stages 2-3
        (which DeepSpeed refuses) each is still reduce-scattered into this
        rank's shard, which is all zcore keeps. The first backward after the
        block that ends the window completes it, and its step applies the
        sum. A ``step()`` inside only counts the micro-step, as after any
        backward within a window (DeepSpeed refuses it; Accelerate's and
        the Trainer's loops step every micro-batch)."""
        if self._no_sync:
            raise InvalidStateError("engine.no_sync() was entered inside another no_sync() block (as DeepSpeed, unsupported)")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """As DeepSpeed's: whether the coming micro-steps end an accumulation,
        decided by the caller instead of counted (a loop whose last
        accumulation of an epoch is shorter: transformers' Trainer). Set it
        before each micro-step's backward."""
        self._boundary = bool(is_boundary)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Back-propagates ``loss`` scaled for accumulation (unless
        ``scale_wrt_gas`` is False: the caller scaled it, as DeepSpeed's
        argument says) and by the fp16 loss scale; gradients are reduced
        across ranks as backward produces them. ``retain_graph``: passed on
        to torch's backward, as DeepSpeed does. Returns, as DeepSpeed's, the
        loss scaled for accumulation (divided by gradient_accumulation_steps
        unless ``scale_wrt_gas`` is False)."""
        self.lifetime.check_usable()
        with self.calls.call(Phase.BACKWARD.value, self.micro_steps):
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(
                    f"engine.backward expects a scalar loss tensor, got "
                    f"{type(loss).__name__} of shape {tuple(getattr(loss, 'shape', ()))}"
                )
            optimizer = self._trainer("backward")
            self.observation.loss(loss)
            factor = optimizer.loss_scale / (self.batch.gradient_accumulation_steps if scale_wrt_gas else 1)
            with self.observation.phase(Phase.BACKWARD):
                self._backward(
                    optimizer, lambda: (loss * factor if factor != 1.0 else loss).backward(retain_graph=retain_graph)
                )
            self.micro_step_phase = MicroStep.AWAITING_STEP
        gas = self.batch.gradient_accumulation_steps
        return loss / gas if scale_wrt_gas and gas != 1 else loss

    def pipeline_backward(self, run: Callable[[float], T], boundary: bool, loss: Optional[torch.Tensor]) -> T:
        """One micro-batch's backward as a pipeline schedule runs it
        (zcore.pipelining): ``run(factor)`` back-propagates with the loss
        scaled by ``factor`` (the loss scale over the accumulation steps);
        ``boundary``: whether it ends the accumulation window (the schedule
        decides, as set_gradient_accumulation_boundary does); ``loss``: the
        micro-batch's loss on the last stage, for the step's record. Call
        ``step()`` after it, as after ``backward``."""
        self.lifetime.check_usable()
        with self.calls.call(Phase.BACKWARD.value, self.micro_steps):
            optimizer = self._trainer("backward")
            if loss is not None:
                self.observation.loss(loss)
            factor = optimizer.loss_scale / self.batch.gradient_accumulation_steps
            self.set_gradient_accumulation_boundary(boundary)
            with self.observation.phase(Phase.BACKWARD):
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
            self.lifetime.break_because(
                f"the backward after step {self.global_steps} failed ({type(cause).__name__}: {cause})"
            )
            return
        dropped = self.accumulated_micro_steps
        self.observation.drop_window()
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
        self.lifetime.check_usable()
        with self.calls.call(Phase.STEP.value, self.micro_steps):
            self._step(lr_kwargs)

    def _step(self, lr_kwargs: Optional[dict]) -> None:
        optimizer = self._trainer("step")
        if self.micro_step_phase is not MicroStep.AWAITING_STEP:
            raise InvalidStateError(
                "engine.step() was called without engine.backward(loss) since the last step, which "
                "would count a micro-step that has no gradients; call engine.backward(loss) first "
                "(every micro-batch: forward, backward, step)"
            )
        stepped = self.is_gradient_accumulation_boundary()
        self.last_step_applied = False
        if stepped:
            skipped = self._optimizer_step(optimizer)
            self.last_step_applied = not skipped
        else:
            self.accumulated_micro_steps += 1
        self.micro_steps += 1
        self.micro_step_phase = MicroStep.AWAITING_BACKWARD
        # Last: a scheduler that raises (ReduceLROnPlateau without its
        # metrics) finds the step taken and counted, not half done.
        if stepped and not skipped and self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        if stepped:  # after the schedule moved, as DeepSpeed's _report_progress
            self.observation.report_progress(self.global_steps, self.skipped_steps, self.get_lr, self.get_mom)

    def _optimizer_step(self, optimizer: ShardedOptimizer) -> bool:
        """The optimizer step that ends an accumulation window, counted and
        recorded; whether it was skipped (fp16 overflow)."""
        self.checkpoints.finish_copy()  # an asynchronous save may still be copying the values this step changes
        self._frozen.report_gradients()
        groups = optimizer.param_groups
        lr = groups[0]["lr"] if groups else None  # the step's, before the scheduler moves it
        profiled = self.observation.profiling
        started = time.perf_counter()
        with self.observation.phase(Phase.STEP):
            self._finish_step()
            self.residency.before_update()
            try:
                result = optimizer.step()
            except BaseException as exc:
                self.lifetime.break_because(
                    f"the optimizer step after step {self.global_steps} failed ({type(exc).__name__}: {exc})"
                )
                raise
            if profiled:
                self._finish_step()  # the profiled step's latency is all of it, not its launch
        seconds = time.perf_counter() - started
        self.last_grad_norm = result.grad_norm
        if result.skipped:
            self.skipped_steps += 1
            log.info("step %d skipped: gradient overflow; loss scale now %g", self.global_steps, optimizer.loss_scale)
        self.global_steps += 1
        self.global_samples += self.batch.train_batch_size
        self.accumulated_micro_steps = 0
        figures = StepFigures(
            global_step=self.global_steps,
            global_samples=self.global_samples,
            batch_size=self.batch.train_batch_size,
            lr=lr,
            grad_norm=result.grad_norm,
            loss_scale=optimizer.loss_scale,
            skipped=result.skipped,
            skipped_steps=self.skipped_steps,
        )
        self.observation.end_step(figures, seconds, profiled, memory=self._measure_memory)
        return result.skipped

    @property
    def last_step_metrics(self) -> Optional[StepRecord]:
        """The last optimizer step's figures (zcore.observe.step_metrics), when
        the config enables a monitor or wall_clock_breakdown; else None."""
        return self.observation.last

    @property
    def flops_report(self) -> Optional[FlopsReport]:
        """The flops profiler's report, once its step has run (None before, or without the profiler)."""
        return self.observation.flops_report

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
            self.lifetime.break_because(
                f"the optimizer step after step {self.global_steps - 1} failed while the next forward "
                f"ran ({type(exc).__name__}: {exc})"
            )
            raise

    @property
    def device_mesh(self) -> Optional[DeviceMesh]:
        """The nodes x ranks mesh hpZ, MiCS and qgZ use (the one given to
        zcore.initialize, or built from LOCAL_WORLD_SIZE), or the "dp" x "tp"
        mesh given (zcore.parallel.mesh); None where no feature needed one."""
        return self.ranks.device_mesh

    def gather_stats(self) -> Any:
        """Stage 3: zcore.zero3.param_fetcher.GatherStats (gathers, prefetch hits and
        misses, peak live elements, arena fallbacks, ...); None otherwise."""
        return self.residency.stats()

    def destroy(self) -> None:
        """Waits for pending writes (an asynchronous checkpoint save's
        included: its failure is raised once the rest is closed) and removes
        this rank's swap files (parameters and optimizer states on NVMe are
        then gone); the engine cannot train after it. Also done when the
        process exits."""
        self.lifetime.destroy(self._close)

    def _out_of_step(self, reason: str) -> None:
        """The ranks fell out of step (zcore.engine.rank_calls): this engine
        cannot go on, as its peers' collectives will never match its own."""
        self.lifetime.break_because(reason)

    def _close(self, was_live: bool) -> None:
        # Each part closes even when one before it raises (callbacks run last-in, first-out).
        with ExitStack() as closing:
            closing.callback(self.calls.close)
            closing.callback(self.observation.close)
            if self.optimizer is not None:
                closing.callback(self.optimizer.close)
            closing.callback(self.residency.close)
            # Runs first (registered last): a pending save finishes before anything closes; it
            # writes its own copy, so it needs none of the parts above.
            closing.callback(self.checkpoints.close)
            if was_live:  # else its failure was raised already
                self._finish_step()

    # Checkpoints (zcore.checkpoint; save_checkpoint and load_checkpoint: zcore.engine.deepspeed_names).
    def restore_counters(self, counters: checkpoint.schema.Counters) -> None:
        """The step counters of a loaded checkpoint, from its validated record."""
        self.global_steps = counters.global_steps
        self.global_samples = counters.global_samples
        self.micro_steps = counters.micro_steps
        self.skipped_steps = counters.skipped_steps
        self.accumulated_micro_steps = 0
        self.micro_step_phase = MicroStep.AWAITING_BACKWARD

    def wait_for_checkpoint(self) -> None:
        """Waits until the asynchronous save in progress (if any) is written
        and published, and raises its failure (every rank the same error
        class a synchronous save raises). Call it on every rank."""
        self.checkpoints.wait()

    def full_state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The whole model's state dict (fp32 master weights, frozen
        parameters, buffers) on rank 0, gathered one unit at a time; an
        empty dict on the other ranks. Call it on every rank."""
        self.lifetime.check_not_destroyed()
        self._finish_step()
        return checkpoint.full_state_dict(self, dtype)

    def memory_report(self) -> MemoryReport:
        """Bytes per rank held for parameters, gradients, optimizer states and
        buffers on each tier (device, host, NVMe): measured, beside what the
        stage's layout and the offload policy predict."""
        self.lifetime.check_not_destroyed()
        self._finish_step()
        return self._measure_memory()

    def _measure_memory(self) -> MemoryReport:
        return measure_memory(self.module, self.optimizer, self.policies, self.residency, self.context.device,
                              checkpoint_copy=self.checkpoints.held_bytes)
