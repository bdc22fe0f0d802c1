"""Sharded construction: a model built on the meta device, materialised one
module at a time straight into its ZeRO-3 shards.

    with torch.device("meta"):
        model = GPT(cfg)
    engine, *_ = zcore.initialize(model, config, meta_init=zcore.MetaInit(init_fn=...))

For each module that owns parameters or meta buffers (in ``named_modules()``
order, see zcore.zero3.sharded_group), they get real storage on the rank's device
(``torch.utils.swap_tensors`` keeps each tensor object, so ties and
optimizers built over the meta model still hold; buffers keep their dtype).
Then the initialisation an eager construction gives them runs: the module's
``reset_parameters()``, the init function on the module, then on each of its
ancestors, innermost first, up to the root. That is the order of Hugging
Face's ``post_init``, whose ``_init_weights`` on a parent may re-initialise
its children's parameters (GPT-2's residual projections, T5's attention).
The init function is ``MetaInit.init_fn``; without one, on a Hugging Face
model, the ``_init_weights`` of the innermost enclosing model (a module that
has ``_init_weights``), as ``post_init`` applies it to nested models. All of
it runs under a seed derived from (seed, module name); every rank then takes
rank 0's values (an init may depend on the rank or on other random state),
the groups keep this rank's slice and the full tensors are dropped before
the next module: the whole model never exists on a rank. torch itself is
not patched.

An ancestor's init runs once for each descendant that owns tensors, so it
must change only that descendant's: every other module's tensors look to it
like meta tensors of their full shape (in-place ops do nothing, indexing
works). Those not materialised yet still are meta; those materialised
before (and since sharded) are stood in for by meta tensors in their
modules' ``_parameters`` and ``_buffers`` until the fill ends, when the
real objects go back.

A parameter that is not on the meta device (built by a legacy constructor
such as ``torch.Tensor(n)``, which ignores the device context, then filled
in ``__init__``) keeps the values it was built with: a module whose
tensors all have values is not initialised again, and in one that also has
meta tensors the init chain's writes to it are undone.

A meta buffer that its init chain never writes is refused, and so is a
floating-point one left partly unset (they start as NaN).

The values are an eager construction's in distribution, not bit for bit
(each module has its own seed); ``module_seed`` is the contract for
reproducing them.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from zcore.comm import collectives as comm
from zcore.errors import ConfigError

InitFn = Callable[[torch.nn.Module], None]
Materialise = Callable[[str, torch.nn.Module, list[torch.nn.Parameter]], None]


@dataclass(frozen=True)
class MetaInit:
    """Each module is initialised as an eager construction would have done:
    ``module.reset_parameters()`` where it has one, then ``init_fn`` on the
    module and on each of its ancestors (a model's own init, such as the
    ``_init_weights`` that models apply after construction; Hugging Face's
    by default); ``seed`` seeds every module's init."""

    init_fn: Optional[InitFn] = None
    seed: int = 0

    def module_seed(self, name: str) -> int:
        """The seed the module named ``name`` is initialised with: the same on every rank and run."""
        return zlib.crc32(f"{self.seed}:{name}".encode())

    @contextlib.contextmanager
    def materialising(
        self, model: torch.nn.Module, device: torch.device, synchronise: bool
    ) -> Iterator[Materialise]:
        """``materialise(name, module, owned)`` for zcore.zero3.sharded_group.fill_groups;
        ``synchronise``: buffers take rank 0's values (fill_groups does the
        parameters). On exit, every module holds its real tensors again."""
        fill = _Fill(self, model, device, synchronise)
        try:
            yield fill.materialise
        finally:
            fill.restore()


class _Fill:
    """One fill, module by module: which tensors are stood in for until it ends."""

    def __init__(
        self, meta_init: MetaInit, model: torch.nn.Module, device: torch.device, synchronise: bool
    ) -> None:
        self._meta_init = meta_init
        self._device = device
        self._synchronise = synchronise
        self._modules = dict(model.named_modules())
        # Every registry entry of each tensor (a tied one has several), so a
        # stand-in replaces it everywhere at once. The tensors outlive the
        # fill (in their modules, then in _stood_in), so their ids stay theirs.
        self._entries: dict[int, list[tuple[dict, str]]] = {}
        for module in self._modules.values():
            for registry in (module._parameters, module._buffers):
                for key, tensor in registry.items():
                    if tensor is not None:
                        self._entries.setdefault(id(tensor), []).append((registry, key))
        self._stood_in: list[tuple[dict, str, torch.Tensor]] = []  # (registry, key, the real tensor)

    def materialise(self, name: str, module: torch.nn.Module, owned: list[torch.nn.Parameter]) -> None:
        """Gives ``owned`` (the module's parameters that no earlier module
        has) and the module's meta buffers real storage and their values."""
        buffers = {
            key: b for key, b in module._buffers.items()
            # A stand-in is meta too, but not one of the registered tensors.
            if b is not None and b.is_meta and id(b) in self._entries
        }
        # Parameters built with values (a legacy constructor such as
        # torch.Tensor(n), which ignores the meta device) keep them.
        given = {id(p): p.detach().clone() for p in owned if not p.is_meta}
        if len(given) == len(owned) and not buffers:
            self._stand_in(owned)
            return
        for p in owned:
            if id(p) in given:
                continue
            real = torch.empty(p.shape, dtype=p.dtype, device=self._device)
            torch.utils.swap_tensors(p, torch.nn.Parameter(real, requires_grad=p.requires_grad))
        for b in buffers.values():
            if b.is_floating_point():  # NaN marks what no init sets
                real = torch.full(b.shape, float("nan"), dtype=b.dtype, device=self._device)
            else:
                real = torch.zeros(b.shape, dtype=b.dtype, device=self._device)
            torch.utils.swap_tensors(b, real)
        versions = {key: b._version for key, b in buffers.items()}  # an init's in-place write bumps it
        devices = [self._device] if self._device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(self._meta_init.module_seed(name))
            self._init(name, module, len(given) < len(owned))
            for p in owned:
                if id(p) in given:
                    p.copy_(given[id(p)])
        untouched = {key for key, b in buffers.items() if b._version == versions[key]}
        if self._synchronise and buffers:
            comm.broadcast_from_rank0(list(buffers.values()))
        for key, b in buffers.items():
            if key in untouched or (b.is_floating_point() and bool(b.isnan().any())):
                raise ConfigError(
                    f"buffer {_qualified(name, key)!r} ({type(module).__name__}) was built on the meta "
                    "device and its initialisation (reset_parameters(), then the init function on the "
                    "module and its ancestors) left it unset (never written, or NaN left in it): pass "
                    "zcore.initialize(meta_init="
                    "zcore.MetaInit(init_fn=...)) with a function that sets it, or create the buffer "
                    "on the CPU (torch.device('cpu') inside the module)"
                )
        self._stand_in([*owned, *buffers.values()])

    def _init(self, name: str, module: torch.nn.Module, has_parameters: bool) -> None:
        lineage = [self._modules[prefix] for prefix in _prefixes(name)]
        fns = _init_fns(self._meta_init.init_fn, lineage)
        reset = getattr(module, "reset_parameters", None)
        if has_parameters and reset is None and fns[0] is None:
            raise ConfigError(
                f"module {name!r} ({type(module).__name__}) was built on the meta device and has no "
                "reset_parameters(); pass zcore.initialize(meta_init=zcore.MetaInit(init_fn=...)) "
                "with a function that initialises a module's parameters (it is applied to each "
                "module, then to its ancestors)"
            )
        if reset is not None:
            reset()
        for ancestor, fn in zip(lineage, fns):
            if fn is not None:
                fn(ancestor)

    def _stand_in(self, tensors: list[torch.Tensor]) -> None:
        """Later modules' init chains see ``tensors`` (given their values,
        soon sharded) as meta tensors of their full shape."""
        for tensor in tensors:
            stand_in = torch.empty_like(tensor, device="meta")
            if isinstance(tensor, torch.nn.Parameter):
                stand_in = torch.nn.Parameter(stand_in, requires_grad=tensor.requires_grad)
            for registry, key in self._entries[id(tensor)]:
                registry[key] = stand_in
                self._stood_in.append((registry, key, tensor))

    def restore(self) -> None:
        for registry, key, tensor in self._stood_in:
            registry[key] = tensor
        self._stood_in.clear()


def _init_fns(init_fn: Optional[InitFn], lineage: list[torch.nn.Module]) -> list[Optional[InitFn]]:
    """Per module of ``lineage`` (a module, then its ancestors up to the
    root): the init function applied to it, if any."""
    if init_fn is not None:
        return [init_fn] * len(lineage)
    fns: list[Optional[InitFn]] = []
    enclosing = None  # Hugging Face's convention: a model inits its modules by _init_weights
    for module in reversed(lineage):
        own = getattr(module, "_init_weights", None)
        if callable(own):
            enclosing = own
        fns.append(enclosing)
    return fns[::-1]


def _prefixes(name: str) -> list[str]:
    """The names of a module and of its ancestors, innermost first: 'a.b', 'a', ''."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _qualified(module: str, key: str) -> str:
    return f"{module}.{key}" if module else key


def is_meta(model: torch.nn.Module) -> bool:
    """Whether the model was built on the meta device: some parameter is
    there (the others, built with values, keep them; buffers may be there
    too, or on the CPU)."""
    on_meta = any(p.is_meta for p in model.parameters())  # those not on it keep their values
    buffers = [n for n, b in model.named_buffers() if b.is_meta]
    if buffers and not on_meta:
        raise ConfigError(
            f"buffers {buffers[:3]} are on the meta device but the model's parameters are not; zcore "
            "materialises a model built wholly under torch.device('meta'): build its parameters there "
            "too, or create the buffers on the CPU (e.g. with torch.device('cpu') inside the module)"
        )
    return on_meta
