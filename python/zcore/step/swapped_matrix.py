"""A whole-matrix optimizer (Muon) with its states on NVMe
(``offload_optimizer.device = "nvme"``; zcore.step.swapped_optimizer).

A matrix piece's per-element states (Muon's momentum) rest in rows 1-2 of
its sub-groups, where Adam's moments rest for the other pieces, in the
order of the optimizer's ``state_keys``. Owner compute
(zcore.step.matrix_step) needs every rank's premixed ranges before any
direction exists, so a step streams the sub-groups twice:

1. those holding a stepping matrix's runs: premix each run (its momentum
   updated, written back), its result kept in host memory, this rank's
   ranges of the matrices in the exchange dtype; a unit's gradient shard is
   held from its first such sub-group to its last;
2. the exchange with the owners and their directions (MatrixStep);
3. every sub-group, as the Adam-only step streams them: each matrix run
   takes its step from its direction (``apply_``) before Adam steps the
   other runs and the compute-dtype shards are written out.

The matrices' sub-groups are read and written twice a step, the others
once; host memory holds the premixed ranges and directions of this rank's
matrix elements (in the exchange dtype: 2 bytes each for Muon, 4 with
"gram") beside the streamed sub-groups and the gradient shards in use.
"""

from __future__ import annotations

from typing import Optional

import torch

from zcore.errors import InvalidStateError
from zcore.optim.matrix_optimizer import MatrixAndElementwise
from zcore.step.grad_reduction import GradientReducer
from zcore.step.matrix_step import Matrix, MatrixStep
from zcore.step.sharded_optimizer import UnitShards
from zcore.step.swapped_optimizer import (
    STATES, SubGroup, SwappedAdamUpdate, SwappedMaster, mark_resting, matrix_rows,
)


class SwappedMatrixUpdate(SwappedAdamUpdate):
    """The step of ``inner`` (a whole-matrix optimizer and zcore's CPU
    Adam) over sub-groups on NVMe (module docstring)."""

    def __init__(
        self, inner: MatrixAndElementwise, master: SwappedMaster, reducer: GradientReducer, shards: UnitShards,
        matrix: MatrixStep, read_ahead: bool = True, write_behind: bool = True,
    ) -> None:
        super().__init__(inner, master, reducer, shards, read_ahead=read_ahead, write_behind=write_behind)
        self.matrix = matrix
        self.rule = inner.matrix
        self._matrix_of = {(m.unit, m.piece): m for m in matrix.matrices if m.piece is not None}
        self._rows = matrix_rows(self.rule)
        # This rank's range of each stepping matrix's direction, during a step.
        self._back: dict[int, torch.Tensor] = {}

    def apply(self, coefficient: float) -> None:
        stepping = self.matrix.stepping(self._used)
        if stepping:
            mine = self._premix(stepping, coefficient)
            self._back = self.matrix.directions(stepping, mine)
        try:
            super().apply(coefficient)
        finally:
            self._back = {}

    def _premix(self, stepping: list[Matrix], coefficient: float) -> dict[int, torch.Tensor]:
        """Pass 1: this rank's premixed range of each stepping matrix it holds."""
        rank, groups, units = self.matrix.rank, self.inner.param_groups, self.master.units
        mine = {
            m.index: torch.empty(m.held(rank), dtype=self.rule.exchange_dtype) for m in stepping if m.piece is not None
        }
        by_piece = {(m.unit, m.piece): m for m in stepping if m.piece is not None}
        subs = {
            s.key: s for s in self.master.sub_groups
            if s.numel > 0 and any((r.unit, r.piece) in by_piece for r in s.runs)
        }
        # Each unit's gradient shard is dropped after the last sub-group of these that needs it.
        last_key = {r.unit: key for key, sub in subs.items() for r in sub.runs if (r.unit, r.piece) in by_piece}
        self._grads.clear()
        for key, states in self.master.swap.stream(subs, read_ahead=self._read_ahead, write_behind=self._write_behind):
            sub = subs[key]
            rows = states.view(STATES, sub.numel)
            for run in sub.runs:
                m = by_piece.get((run.unit, run.piece))
                if m is None:
                    continue
                part = rows[:, run.offset : run.offset + run.numel]
                grad = self._grad(run)
                grad = (grad * coefficient if coefficient != 1.0 else grad).to(part.dtype)
                views = {k: part[row] for k, row in self._rows.items()}
                state = dict(views)
                mixed = self.rule.premix(grad, state, groups[m.group])
                if state.keys() != views.keys():
                    raise InvalidStateError(
                        f"{type(self.rule).__name__}.premix keeps the per-element states {sorted(state)}, but its "
                        f"state_keys declare {sorted(views)}: with the optimizer's states on NVMe only declared "
                        "states rest there; declare them in state_keys (at most two)"
                    )
                for k, view in views.items():
                    if state[k] is not view:  # replaced rather than updated in place
                        view.copy_(state[k])
                lo = run.unit_start - units[run.unit].pieces[run.piece].shard_start
                mine[m.index][lo : lo + run.numel].copy_(mixed)
                piece = self.master.pieces[run.unit][run.piece]
                mark_resting(self.inner.state[piece], list(self._rows), piece)
            for u in [u for u, last in last_key.items() if last == key]:
                self._grads.pop(u, None)
            del states, rows
        self._grads.clear()
        return mine

    def _step_matrices(self, sub: SubGroup, states: torch.Tensor) -> None:
        """Pass 3: each matrix run in ``sub`` takes its step."""
        if not self._back:
            return
        groups, units = self.inner.param_groups, self.master.units
        for run in sub.runs:
            m: Optional[Matrix] = self._matrix_of.get((run.unit, run.piece))
            if m is None or m.index not in self._back:
                continue
            lo = run.unit_start - units[run.unit].pieces[run.piece].shard_start
            direction = self._back[m.index][lo : lo + run.numel]
            self.rule.apply_(states[0, run.offset : run.offset + run.numel], direction, groups[m.group], m.shape)

    def state_bytes(self) -> int:
        return self.matrix.state_bytes()

    def check_saveable(self) -> None:
        self.matrix.check_saveable()
