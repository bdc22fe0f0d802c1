"""zcore under torch's pipeline parallelism (``torch.distributed.pipelining``).

Each rank of a mesh's ``"pp"`` dimension holds one stage of the model, and
zcore shards that stage over the mesh's ``"dp"`` dimension
(zcore.parallel.mesh). ``PipelineStage(engine, stage_index, num_stages)``
is torch's stage over the engine: give it to any of torch's single-stage
schedules (``ScheduleGPipe``, ``Schedule1F1B``) built with
``n_microbatches`` equal to the config's ``gradient_accumulation_steps``
and torch's default ``scale_grads=True``. A weight that several stages
hold (a tied embedding and LM head) is named on each with one key in
``zcore.initialize(..., tied_parameters={key: parameter})``: zcore sums its
gradient over those stages before each step, so the copies stay equal.
One ``schedule.step(...)`` is
then one training step, as DeepSpeed's ``train_batch()``: each
micro-batch's forward runs through the engine, each backward is one of the
engine's micro-steps (its loss scaled by the fp16 loss scale over the
accumulation steps, on the last stage, as ``engine.backward`` would), and
once every backward of the schedule is done and its gradients sent, the
optimizer steps.

What each ZeRO stage costs under micro-batching, per step of m micro-batches:
stage 1 reduces each unit's gradients once (during the last backward) and
gathers the updated shards once; stage 2 reduce-scatters every
micro-batch's gradients (m reduce-scatters) to hold only the shard; stage 3
also all-gathers each group's parameters for every micro-batch's forward
and backward (2m all-gathers), unless the live budget lets them stay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage as TorchPipelineStage

from zcore.comm import collectives as comm
from zcore.errors import ConfigError, InvalidStateError
from zcore.parallel.dtensor import local_tensor
from zcore.parallel.mesh import PIPELINE_PARALLEL, ModelParallelMesh


class PipelineStage(TorchPipelineStage):
    """torch's PipelineStage over a zcore engine built with a mesh that has
    a ``"pp"`` dimension; ``kwargs``: torch's (``input_args``, ...)."""

    def __init__(self, engine: Any, stage_index: int, num_stages: int, **kwargs: Any) -> None:
        mesh = engine.ranks.model_parallel
        if mesh is None or PIPELINE_PARALLEL not in mesh.mesh.mesh_dim_names:
            raise ConfigError(
                "zcore.pipelining.PipelineStage needs an engine built with a device_mesh that has a "
                "\"pp\" dimension (and \"dp\"): pass zcore.initialize(..., device_mesh=mesh)"
            )
        pp = mesh.mesh[PIPELINE_PARALLEL]
        if num_stages != pp.size() or stage_index != pp.get_local_rank():
            raise ConfigError(
                f"stage {stage_index} of {num_stages} on this rank, but the mesh's \"pp\" dimension has "
                f"{pp.size()} ranks and this rank is its {pp.get_local_rank()}: one stage per rank, in mesh order"
            )
        super().__init__(engine.module, stage_index, num_stages, engine.context.device, group=pp.get_group(), **kwargs)
        self.engine = engine

    def _prepare_forward_infra(self, num_microbatches: int, *args: Any, **kwargs: Any) -> Any:
        """Before the schedule's first exchange, on every stage alike, so that
        a refusal here leaves no stage waiting for another."""
        gas = self.engine.gradient_accumulation_steps()
        if num_microbatches != gas:
            raise ConfigError(
                f"the schedule runs {num_microbatches} micro-batches per step but gradient_accumulation_steps "
                f"is {gas}: one zcore micro-step per micro-batch, so set them equal"
            )
        return super()._prepare_forward_infra(num_microbatches, *args, **kwargs)

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        """The stage's forward through its zcore engine (called by torch's schedules)."""
        return self.engine(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        """The stage's backward through its zcore engine (called by torch's
        schedules); only full backwards, not split input and weight ones."""
        if backward_type != "full":
            raise InvalidStateError(
                f"a {backward_type}-only backward: zcore reduces a parameter's gradient once it is whole, so "
                "schedules that split backward into input and weight parts (zero-bubble) are not supported; "
                "use ScheduleGPipe or Schedule1F1B"
            )
        torch_backward = super().backward_maybe_with_nosync

        def run(factor: float) -> Any:
            kwargs = bwd_kwargs
            if self.is_last and factor != 1.0:  # the loss; earlier stages receive gradients of it scaled
                kwargs = {**bwd_kwargs, "stage_output": bwd_kwargs["stage_output"] * factor}
            return torch_backward(backward_type, kwargs, last_backward=last_backward)

        loss = bwd_kwargs["stage_output"] if self.is_last else None
        result = self.engine.pipeline_backward(run, boundary=last_backward, loss=loss)
        if not last_backward:
            self.engine.step()  # counts the micro-step; the optimizer steps in perform_reduce_grad
        return result

    def scale_grads(self, grad_scale_factor: int) -> None:
        """zcore scaled each micro-batch's loss already (and holds no .grad)."""

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """After the schedule's last backward and sends: the optimizer step."""
        gas = self.engine.gradient_accumulation_steps()
        if grad_scale_factor != gas:
            raise ConfigError(
                f"the schedule scales gradients by 1/{grad_scale_factor}, but zcore scales each of the "
                f"{gas} micro-batches' losses by 1/{gas} (a mean over the micro-batches): build the schedule "
                "with scale_grads=True (torch's default) and a loss_fn that averages"
            )
        self.engine.step()


@dataclass(frozen=True)
class Tie:
    """A weight that several stages hold (a tied embedding and LM head), in
    unit ``unit`` of this stage alone: its gradient shards are summed over
    ``group`` (this dp rank's copies on those stages) before each step, so
    every copy takes the same update; the first stage holding it counts it
    in the gradient norm (``counted``)."""

    unit: int
    group: dist.ProcessGroup
    counted: bool


def tie_parameters(
    tied: dict[str, torch.nn.Parameter], units: list, mesh: ModelParallelMesh
) -> list[Tie]:
    """This stage's ties, from ``tied`` (key -> this stage's copy; every
    stage holding a weight names it with the same key). Collective: every
    rank of the world calls it, with or without ties of its own, and what
    any rank got wrong is raised on every rank (``mesh`` pipelines)."""
    stage = mesh.mesh[PIPELINE_PARALLEL].get_local_rank()
    dp = mesh.data_parallel
    # The ranks that hold one copy each: the same dp and tp coordinates, one per stage.
    place = (dp.rank, mesh.tp_rank)
    unit_of = {id(unit.params[0]): u for u, unit in enumerate(units) if len(unit.params) == 1}
    problem = None
    wrong = [key for key, param in tied.items() if id(param) not in unit_of]
    if wrong:
        problem = (
            f"tied_parameters[{wrong[0]!r}] on stage {stage} is not a trained parameter of the stage's "
            "model; pass the Parameter object the stage's module holds (requires_grad=True)"
        )
    numels = {key: local_tensor(param).numel() for key, param in tied.items()}  # this rank's slice
    everyone = comm.all_gather_objects((dist.get_rank(), stage, place, numels, problem))
    problems = [p for *_, p in everyone if p is not None]
    if problems:
        raise ConfigError(problems[0])
    rank_of = {(s, d): r for r, s, d, _, _ in everyone}
    places = sorted({d for _, _, d, _, _ in everyone})
    holders: dict[str, dict[int, int]] = {}  # key -> stage -> elements
    for _, s, d, held, _ in everyone:
        for key, numel in held.items():
            holders.setdefault(key, {})
            if holders[key].setdefault(s, numel) != numel:
                raise ConfigError(f"tied_parameters[{key!r}] has {numel} elements on one rank of stage {s} and "
                                  f"{holders[key][s]} on another: every rank of a stage passes the same weights")
    ties = []
    for key in sorted(holders):
        stages = sorted(holders[key])
        if len(stages) < 2:
            raise ConfigError(
                f"tied_parameters[{key!r}] is given on stage {stages[0]} only; give the same key on every stage "
                "that holds the weight (a tied embedding: the first and the last stage)"
            )
        sizes = {holders[key][s] for s in stages}
        if len(sizes) > 1:
            raise ConfigError(
                f"tied_parameters[{key!r}] names weights of {sorted(sizes)} elements on stages {stages}: a tied "
                "weight is one shape on every stage"
            )
        missing = [(s, d) for s in stages for d in places if key not in everyone[rank_of[(s, d)]][3]]
        if missing:
            raise ConfigError(
                f"tied_parameters[{key!r}] is given on some ranks of stage {missing[0][0]} but not on its rank "
                f"at (dp, tp) = {missing[0][1]}: every rank of a stage passes the same ties"
            )
        for d in places:  # every rank creates every group, in one order
            group = dist.new_group([rank_of[(s, d)] for s in stages])
            if d == place and key in tied:
                ties.append(Tie(unit_of[id(tied[key])], group, counted=stage == stages[0]))
    return ties
