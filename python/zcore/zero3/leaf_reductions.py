"""ZeRO-3: when the gradients of a leaf module's parameters may be reduced.

Note "leaf gradients": inside a leaf module (zcore.zero3.leaf_modules) ranks
may run different parameters (the experts their tokens reach), so a rank's
parameters of the leaf get their gradients at points of backward that other
ranks do not share, or never. The reducer launches a unit as soon as its
gradients are in (zcore.step.grad_reduction), which would put the leaf's
reduce-scatters at different places among each rank's collectives. So the
reducer holds the leaf's units, and they are released when every call of
the leaf in the step has left its backward, a point every rank shares: its
parameters with no gradient on this rank then contribute zeros, as DeepSpeed
does at the leaf's backward hook. Autograd accumulates a parameter's
gradient as soon as the node computing it has run (AccumulateGrad runs
first among the ready nodes), so the leaf's gradients that depend on its
inputs are in by the time the gradients of its inputs leave it.

A leaf call whose inputs take no gradient has no such point before the end
of backward (its parameters' gradients, the usual sign, differ by rank): it
stays in backward until the step ends, and its units are released there.
"""

from __future__ import annotations

from typing import Callable

from zcore.zero3.module_calls import ModuleCall

Release = Callable[[list[int]], None]


def _no_reducer(groups: list[int]) -> None:
    """Inference: nothing reduces gradients."""


class LeafReductions:
    def __init__(self, groups_of_leaf: dict[int, list[int]]) -> None:
        """``groups_of_leaf``: per hooked leaf module k, the trained groups
        its subtree owns (those it uses but another module owns are reduced
        as that module's)."""
        self._groups = groups_of_leaf
        self._open: dict[int, int] = {}  # leaf k -> calls of this step whose backward is still to be left
        self._release: Release = _no_reducer

    def is_leaf(self, k: int) -> bool:
        return k in self._groups

    def held_groups(self) -> list[int]:
        """The groups whose reduction waits for their leaf."""
        return sorted({g for groups in self._groups.values() for g in groups})

    def set_release(self, release: Release) -> None:
        """``release(groups)``: the reducer may reduce these groups now."""
        self._release = release

    def entered(self, call: ModuleCall, grad: bool) -> None:
        """A forward call began (``grad``: with autograd recording); a
        recomputation's backward is its original call's."""
        if grad and not call.recomputed and call.index in self._groups:
            self._open[call.index] = self._open.get(call.index, 0) + 1

    def left(self, call: ModuleCall) -> None:
        """``call`` left its backward."""
        k = call.index
        if call.recomputed or k not in self._open:
            return
        self._open[k] -= 1
        if self._open[k] == 0:
            del self._open[k]
            self._release(self._groups[k])

    def end_step(self) -> None:
        """Calls whose backward never came release nothing: the reducer
        launches what is still held at the end of backward."""
        self._open.clear()
