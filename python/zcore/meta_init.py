"""Sharded construction: a model built on the meta device, materialised one
module at a time straight into its ZeRO-3 shards.

    with torch.device("meta"):
        model = GPT(cfg)
    engine, *_ = zcore.initialize(model, config, meta_init=zcore.MetaInit(init_fn=...))

For each module that owns parameters (in ``named_modules()`` order, see
zcore.sharded_group), its parameters get real storage on the rank's device
(``torch.utils.swap_tensors`` keeps each Parameter object, so ties and
optimizers built over the meta model still hold), its initialisation runs
under a seed derived from (seed, module name) so that every rank computes
the same values without communicating, then the group keeps this rank's
slice and the full tensors are dropped before the next module: the whole
model never exists on a rank. torch itself is not patched.

The values differ from an eager construction's (each module has its own
seed); ``module_seed`` is the contract for reproducing them.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from zcore.errors import ConfigError


@dataclass(frozen=True)
class MetaInit:
    """Each module is initialised as its constructor would have done,
    ``module.reset_parameters()`` where it has one, then by ``init_fn(module)``
    where given (a model's own init, such as the ``_init_weights`` that
    models apply after construction); ``seed`` seeds every module's init."""

    init_fn: Optional[Callable[[torch.nn.Module], None]] = None
    seed: int = 0

    def module_seed(self, name: str) -> int:
        return zlib.crc32(f"{self.seed}:{name}".encode())

    def materialise(
        self, name: str, module: torch.nn.Module, owned: list[torch.nn.Parameter], device: torch.device
    ) -> None:
        for p in owned:
            real = torch.nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad
            )
            torch.utils.swap_tensors(p, real)
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(self.module_seed(name))
            self._init(name, module)

    def _init(self, name: str, module: torch.nn.Module) -> None:
        reset = getattr(module, "reset_parameters", None)
        if reset is None and self.init_fn is None:
            raise ConfigError(
                f"module {name!r} ({type(module).__name__}) was built on the meta device and has no "
                "reset_parameters(); pass zcore.initialize(meta_init=zcore.MetaInit(init_fn=...)) "
                "with a function that initialises one module's own parameters"
            )
        if reset is not None:
            reset()
        if self.init_fn is not None:
            self.init_fn(module)


def is_meta(model: torch.nn.Module) -> bool:
    meta = [p.is_meta for p in model.parameters()]
    if any(meta) and not all(meta):
        raise ConfigError(
            "some of the model's parameters are on the meta device and some are not; build the "
            "whole model under torch.device('meta') (or none of it)"
        )
    buffers = [n for n, b in model.named_buffers() if b.is_meta]
    if buffers:
        raise ConfigError(
            f"buffers {buffers[:3]} are on the meta device; zcore materialises parameters only: "
            "create buffers on the CPU (e.g. with torch.device('cpu') inside the module)"
        )
    return bool(meta) and all(meta)
