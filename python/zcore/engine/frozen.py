"""Parameters frozen at ``zcore.initialize``: zcore never trains them, so a
gradient they get later (requires_grad set since) is reported once, by
name, instead of being ignored silently."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("zcore")


class FrozenParameters:
    def __init__(self, module: torch.nn.Module) -> None:
        self._frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        self._reported = False

    def report_gradients(self) -> None:
        """Warns once when any of them holds a gradient."""
        if self._reported:
            return
        unfrozen = [n for n, p in self._frozen if p.grad is not None]
        if unfrozen:
            self._reported = True
            log.warning(
                "parameters frozen at zcore.initialize got gradients and are not trained: %s. zcore trains "
                "the parameters that require grad at initialize; set requires_grad before it to train these",
                ", ".join(unfrozen[:8]) + (" ..." if len(unfrozen) > 8 else ""),
            )
