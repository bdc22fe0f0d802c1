"""ZeRO-3: the forwards whose backward has not run yet.

A training step is one trace from the first forward to the last backward.
Most loops run one forward and then its backward, but some run several
forwards before the first backward (``loss = f(engine(x0)) ...``, then
each loss's backward in turn, as a pipeline schedule or a contrastive loop
does). Their step must not end at the first backward, nor at the second
forward: the later backward would then run outside any step, and what it
gathers would outlive the optimizer's update.

A forward is pending from its return until autograd runs the node that
produced one of its outputs, or until its graph is freed unused (its
outputs dropped). Each pass leaves a marker in those nodes' metadata, so
the graph alone keeps it alive: the tracker holds the markers weakly.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Iterator

import torch


class ForwardPass:
    """The marker of one forward, kept by its output nodes."""

    __slots__ = ("__weakref__",)


class PendingBackwards:
    def __init__(self) -> None:
        self._pending: weakref.WeakSet[ForwardPass] = weakref.WeakSet()

    def add(self, outputs: Any) -> None:
        """After a forward with grad enabled: ``outputs`` (tensors, nested in
        tuples, lists and mappings) await their backward."""
        nodes = {id(t.grad_fn): t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None}
        if not nodes:
            return
        marker = ForwardPass()
        pending = self._pending
        for node in nodes.values():
            node.metadata.setdefault("zcore_forward_passes", []).append(marker)
            node.register_prehook(lambda _grads, marker=marker: pending.discard(marker))
        pending.add(marker)

    def any(self) -> bool:
        return len(self._pending) > 0

    def clear(self) -> None:
        """The passes still pending are given up (their step was ended)."""
        self._pending.clear()


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
