"""DeepSpeed's flops profiler: each module's parameters, FLOPs and forward
latency at one optimizer step, printed by rank 0 (or written to
``flops_profiler.output_file``).

Which step. ``profile_step`` counts as DeepSpeed's ``global_steps`` does:
the optimizer steps completed before the profiled one. The default, 1,
profiles the second optimizer step: the first (global step 0) records
zcore's stage-3 trace and warms up, so its latencies say little. Every
micro-batch of the profiled step counts: FLOPs and latencies are summed
over its forward passes (DeepSpeed reports the last micro-batch alone).

What is counted. FLOPs are torch's ``FlopCounterMode``'s (matrix products,
convolutions, attention; elementwise operations count nothing). Forward
FLOPs are attributed to the modules running when each operator runs.
Backward FLOPs are the model's as a whole: everything counted from the
first gradient of the model's output to the end of that backward, forwards
recomputed under activation checkpointing included, which is why
``recompute_fwd_factor`` (DeepSpeed's guess at the recomputed share) is
refused. (Per module they are not reported: torch's module tracker loses
its place when a checkpointed module is recomputed.) A module's forward
latency runs from before zcore's pre-forward hook (its parameters' gather)
to after its post-forward hook (their release), so it is what the module
costs in this engine; the backward latency spans the same window as the
backward FLOPs. Parameters are counted whole at stage 3 too
(zcore.zero3.sharded_parameter).

Cost. Nothing is installed before the profiled step or after it; during
it, module hooks, a multi-gradient hook per forward and the FLOP counter's
dispatch mode, whose overhead the reported latencies include (as
DeepSpeed's do).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from zcore.config.schema import FlopsProfilerConfig
from zcore.errors import ConfigError, InvalidStateError
from zcore.nested import tensors_in


def _cpu_attention(query_shape, key_shape, value_shape, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_attention_backward(grad_shape, query_shape, key_shape, value_shape, *args: Any, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_shape, query_shape, key_shape, value_shape)


# torch's counter knows the CUDA attention kernels but not the CPU one that
# scaled_dot_product_attention runs on a CPU device: the same formulas.
_CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}


def flop_counter() -> FlopCounterMode:
    """torch's FLOP counter, knowing the CPU attention kernel too."""
    return FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION)


class ProfilerState(enum.Enum):
    """Where a FlopsProfiler is in its one profiled step."""

    WAITING = "waiting"  # nothing installed; start() when the step comes
    PROFILING = "profiling"  # hooks and the FLOP counter installed
    DONE = "done"  # reported (or closed); it never profiles again


@dataclass(frozen=True)
class ModuleProfile:
    name: str  # qualified name in the model, "" for the model itself
    kind: str  # class name
    depth: int  # 0 for the model, 1 for its children, ...
    params: int  # the module's parameters, its submodules' included, each counted once
    fwd_flops: int  # over the step's forward passes, submodules included
    fwd_latency: float  # seconds, over the step's forward passes


@dataclass(frozen=True)
class FlopsReport:
    step: int  # the profiled step's global step (profile_step)
    forwards: int  # forward passes of the model in the step (micro-batches)
    world_size: int
    modules: tuple[ModuleProfile, ...]  # in model.named_modules() order: the model first
    bwd_flops: int  # the model's, over the step's backward passes, recomputed forwards included
    bwd_latency: float  # seconds, over the step's backward passes
    step_latency: Optional[float]  # the optimizer step's seconds, when the engine gave them
    text: str  # the report as printed

    @property
    def model(self) -> ModuleProfile:
        return self.modules[0]

    @property
    def flops(self) -> int:
        """The model's forward and backward FLOPs in the step."""
        return self.model.fwd_flops + self.bwd_flops

    def module(self, name: str) -> ModuleProfile:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"no module named {name!r} in the profiled model")


class FlopsProfiler:
    """Profiles one optimizer step of ``module``, as the config says.

    The engine calls ``start()`` before the first forward of a micro-step for
    which ``profiles(global_steps)`` is true, ``stop()`` after that step's
    optimizer step, and ``close()`` when it is destroyed.
    """

    def __init__(self, module: torch.nn.Module, config: FlopsProfilerConfig, rank: int, world_size: int) -> None:
        _check_config(config, rank)
        self.module = module
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.state = ProfilerState.WAITING
        self._session: Optional[_Session] = None

    def profiles(self, global_step: int) -> bool:
        """Whether the micro-steps run at ``global_step`` (optimizer steps
        completed so far) belong to the profiled step."""
        return global_step == self.config.profile_step

    def start(self) -> None:
        self._expect(ProfilerState.WAITING, "start")
        self._session = _Session(self.module)
        self.state = ProfilerState.PROFILING

    def stop(self, step_seconds: Optional[float] = None) -> FlopsReport:
        """Removes what start() installed and returns the report; rank 0
        prints it, or writes it to ``output_file``. ``step_seconds``: the
        optimizer step's duration, when the engine measured it."""
        self._expect(ProfilerState.PROFILING, "stop")
        measured = self._finish()
        report = _report(self.module, measured, self.config, self.world_size, step_seconds)
        if self.rank == 0:
            _emit(report.text, self.config.output_file)
        return report

    def close(self) -> None:
        """Removes what start() installed, reporting nothing (the run ended
        inside the profiled step)."""
        if self.state is ProfilerState.PROFILING:
            self._finish()
        self.state = ProfilerState.DONE

    def _finish(self) -> _Measured:
        session, self._session = self._session, None
        self.state = ProfilerState.DONE
        return session.finish()

    def _expect(self, state: ProfilerState, doing: str) -> None:
        if self.state is not state:
            raise InvalidStateError(
                f"FlopsProfiler.{doing}() while {self.state.value}; it needs {state.value} (start() before "
                "the profiled step's first forward, stop() after its optimizer step, once)",
                state=self.state.value,
            )


def _check_config(config: FlopsProfilerConfig, rank: int) -> None:
    if config.recompute_fwd_factor != 0:
        raise ConfigError(
            f"flops_profiler.recompute_fwd_factor={config.recompute_fwd_factor}: zcore counts the backward's "
            "FLOPs, forwards recomputed under activation checkpointing included, so it needs no estimate "
            "of them; remove the key (or set it to 0)"
        )
    if rank == 0 and config.output_file:
        problem = _unwritable(config.output_file)
        if problem:
            raise ConfigError(
                f"flops_profiler.output_file={config.output_file!r}: {problem}; give a file path rank 0 can write"
            )


def _unwritable(path: str) -> Optional[str]:
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return "it is a directory"
    parent = os.path.dirname(path)
    while not os.path.exists(parent):  # created when the report is written
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    return None


@dataclass(frozen=True)
class _Measured:
    forwards: int
    fwd_flops: dict[str, int]  # by ModuleTracker name (see _tracker_names)
    bwd_flops: int
    fwd_latency: dict[torch.nn.Module, float]
    bwd_latency: float


class _Session:
    """What runs during the profiled step: the FLOP counter, a forward pre-
    and post-hook per module timing it, and on each forward's output a hook
    timing the backward. The model's own hooks also split the counts into
    forward and backward: what is counted between its pre- and post-hook is
    forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._synchronize: Callable[[], None] = (
            torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else _nothing
        )
        self._in_forward = False  # within the model's forward: not a recomputation during backward
        self._forwards = 0
        self._counts_before: dict[str, int] = {}  # at the start of the model's forward
        self._fwd_flops: dict[str, int] = defaultdict(int)
        self._latency: dict[torch.nn.Module, float] = defaultdict(float)
        self._entered: dict[torch.nn.Module, list[float]] = defaultdict(list)  # a stack: a module may recurse
        self._backward_timed = False  # a backward of the model is being measured
        self._bwd_flops = 0
        self._bwd_latency = 0.0
        self._handles: list[Any] = []
        _warm_up_counter()
        self._counter = flop_counter()
        self._counter.__enter__()
        for module in model.modules():
            # prepend: before zcore's pre-hook, which gathers the module's parameters.
            self._handles.append(module.register_forward_pre_hook(self._enter, prepend=True))
            self._handles.append(module.register_forward_hook(self._leave))

    def finish(self) -> _Measured:
        for handle in self._handles:
            handle.remove()
        self._counter.__exit__(None, None, None)
        return _Measured(
            forwards=self._forwards,
            fwd_flops=dict(self._fwd_flops),
            bwd_flops=self._bwd_flops,
            fwd_latency=dict(self._latency),
            bwd_latency=self._bwd_latency,
        )

    def _counts(self) -> dict[str, int]:
        return {name: sum(ops.values()) for name, ops in self._counter.get_flop_counts().items()}

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if module is self._model and not self._in_forward:
            self._in_forward = True
            self._counts_before = self._counts()
        if self._in_forward:
            self._synchronize()
            self._entered[module].append(time.perf_counter())

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._in_forward or not self._entered[module]:
            return
        self._synchronize()
        self._latency[module] += time.perf_counter() - self._entered[module].pop()
        if module is self._model and not self._entered[module]:
            self._in_forward = False
            self._forwards += 1
            for name, count in self._counts().items():
                self._fwd_flops[name] += count - self._counts_before.get(name, 0)
            self._time_backward(output)

    def _time_backward(self, output: Any) -> None:
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if tensors:
            self._handles.append(register_multi_grad_hook(tensors, self._backward_begins, mode="any"))

    def _backward_begins(self, grad: Any) -> None:
        if self._backward_timed:  # one backward through the outputs of several forwards
            return
        self._backward_timed = True
        self._synchronize()
        began = time.perf_counter()
        callback = functools.partial(self._backward_ends, began, self._counter.get_total_flops())
        torch.autograd.Variable._execution_engine.queue_callback(callback)

    def _backward_ends(self, began: float, flops_before: int) -> None:
        self._synchronize()
        self._bwd_latency += time.perf_counter() - began
        self._bwd_flops += self._counter.get_total_flops() - flops_before
        self._backward_timed = False


def _nothing() -> None:
    pass


def _warm_up_counter() -> None:
    """The counter's first operator in a process imports torch._dynamo
    (about 1 s): done here, not inside the first module timed."""
    with FlopCounterMode(display=False):
        torch.ones(1, 1) @ torch.ones(1, 1)


def _tracker_names(model: torch.nn.Module) -> dict[torch.nn.Module, str]:
    """The names torch's ModuleTracker (the FLOP counter's) gives the
    model's modules, the model being the first it sees: its class name, then
    ``.child`` per level, a shared module taking its last name."""
    names = {model: type(model).__name__}
    seen: set[int] = set()

    def visit(module: torch.nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child_name, child in module.named_children():
            names[child] = f"{names[module]}.{child_name}"
            visit(child)

    visit(model)
    return names


def _report(
    model: torch.nn.Module,
    measured: _Measured,
    config: FlopsProfilerConfig,
    world_size: int,
    step_seconds: Optional[float],
) -> FlopsReport:
    tracker = _tracker_names(model)
    modules = tuple(
        ModuleProfile(
            name=name,
            kind=type(module).__name__,
            depth=0 if name == "" else name.count(".") + 1,
            params=sum(p.numel() for p in module.parameters()),
            fwd_flops=measured.fwd_flops.get(tracker[module], 0),
            fwd_latency=measured.fwd_latency.get(module, 0.0),
        )
        for name, module in model.named_modules()
    )
    report = FlopsReport(
        step=config.profile_step,
        forwards=measured.forwards,
        world_size=world_size,
        modules=modules,
        bwd_flops=measured.bwd_flops,
        bwd_latency=measured.bwd_latency,
        step_latency=step_seconds,
        text="",
    )
    return dataclasses.replace(report, text=_render(report, config))


def _emit(text: str, output_file: Optional[str]) -> None:
    if not output_file:
        print(text, flush=True)
        return
    os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
    with open(output_file, "w") as f:
        f.write(text + "\n")


# The report's text, laid out as DeepSpeed's.

_LINE = "{:<66}{}"


def _render(report: FlopsReport, config: FlopsProfilerConfig) -> str:
    lines = [
        "",
        "-------------------------- zcore flops profiler --------------------------",
        f"Profile at step {report.step} (optimizer steps completed before it), per rank, over the step's "
        f"{report.forwards} forward pass{'es' if report.forwards != 1 else ''}:",
        *_summary(report),
        "",
        "----------------------------- Aggregated profile -----------------------------",
        *_aggregated(report.modules, config.module_depth, config.top_modules),
    ]
    if config.detailed:
        lines += [
            "",
            "------------------------------ Detailed profile ------------------------------",
            "Each module: params, % of the model's params, fwd FLOPs, % of the model's fwd FLOPs, fwd "
            "latency, % of the model's fwd latency, fwd FLOPS (fwd FLOPs / fwd latency).",
            "A parent's FLOPs and latency include its submodules' and what it computes itself; FLOPs count "
            "matrix products, convolutions and attention only.",
            "",
            *_tree(report.modules),
        ]
    lines.append("------------------------------------------------------------------------------")
    return "\n".join(lines)


def _summary(report: FlopsReport) -> list[str]:
    model = report.model
    fwd, bwd, total = model.fwd_flops, report.bwd_flops, report.flops
    lines = [
        _LINE.format("world size:", report.world_size),
        _LINE.format("params of the model:", _count(model.params)),
        _LINE.format("fwd FLOPs:", _count(fwd)),
        _LINE.format("bwd FLOPs:", _count(bwd)),
        _LINE.format("fwd+bwd FLOPs:", _count(total)),
        _LINE.format("fwd latency:", _duration(model.fwd_latency)),
        _LINE.format("fwd FLOPS = fwd FLOPs / fwd latency:", _rate(fwd, model.fwd_latency)),
    ]
    if report.bwd_latency > 0:
        lines += [
            _LINE.format("bwd latency:", _duration(report.bwd_latency)),
            _LINE.format("bwd FLOPS = bwd FLOPs / bwd latency:", _rate(bwd, report.bwd_latency)),
            _LINE.format(
                "fwd+bwd FLOPS = fwd+bwd FLOPs / (fwd+bwd latency):",
                _rate(total, model.fwd_latency + report.bwd_latency),
            ),
        ]
    if report.step_latency is not None:
        iteration = model.fwd_latency + report.bwd_latency + report.step_latency
        lines += [
            _LINE.format("step latency:", _duration(report.step_latency)),
            _LINE.format("iter latency = fwd + bwd + step latency:", _duration(iteration)),
            _LINE.format("FLOPS = fwd+bwd FLOPs / iter latency:", _rate(total, iteration)),
        ]
    return lines


def _aggregated(modules: tuple[ModuleProfile, ...], module_depth: int, top_modules: int) -> list[str]:
    """Per depth, the ``top_modules`` module classes with the most params,
    fwd FLOPs and fwd latency, summed over that depth's modules of the class."""
    deepest = max(m.depth for m in modules)
    last = deepest if module_depth == -1 else min(module_depth, deepest)
    lines = [f"Top {top_modules} modules in terms of params, fwd FLOPs or fwd latency at depths 0 to {last}:"]
    for depth in range(last + 1):
        by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
        for m in modules:
            if m.depth == depth:
                totals = by_kind[m.kind]
                totals[0] += m.params
                totals[1] += m.fwd_flops
                totals[2] += m.fwd_latency
        lines.append(f"depth {depth}:")
        for label, column, show in (("params", 0, _count), ("fwd FLOPs", 1, _count), ("fwd latency", 2, _duration)):
            top = sorted(by_kind.items(), key=lambda item: item[1][column], reverse=True)[:top_modules]
            lines.append(f"    {label:<11} - {{{', '.join(f'{k!r}: {show(v[column])!r}' for k, v in top)}}}")
    return lines


def _tree(modules: tuple[ModuleProfile, ...]) -> list[str]:
    model = modules[0]
    lines = []
    for m in modules:
        figures = ", ".join(
            (
                f"{_count(m.params)} = {_percent(m.params, model.params)} params",
                f"{_count(m.fwd_flops)} = {_percent(m.fwd_flops, model.fwd_flops)} fwd FLOPs",
                f"{_duration(m.fwd_latency)} = {_percent(m.fwd_latency, model.fwd_latency)} fwd latency",
                _rate(m.fwd_flops, m.fwd_latency),
            )
        )
        label = m.kind if m.depth == 0 else f"({m.name.rsplit('.', 1)[-1]}) {m.kind}"
        lines.append(f"{'  ' * m.depth}{label}: {figures}")
    return lines


def _count(n: float, unit: str = "") -> str:
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.4g} {unit}".rstrip()


def _rate(flops: float, seconds: float) -> str:
    return _count(flops / seconds if seconds > 0 else 0, "FLOPS")


def _duration(seconds: float) -> str:
    if seconds == 0:
        return "0 s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.2f} us"


def _percent(part: float, whole: float) -> str:
    return f"{round(100 * part / whole, 2):g}%" if whole else "0%"
