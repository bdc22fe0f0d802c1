"""torch.compile under zcore (note "compiled units").

Note "compiled units": at stage 3 a module whose forward runs compiled
(``module.compile()``, which compiles its ``_call_impl``, or
``torch.compile(module)`` put in its parent's place, an ``OptimizedModule``)
is hooked as one unit, as FSDP2 hooks a block under ``fully_shard``:
- its hooks run outside the compiled region (``torch.compiler.disable``:
  Dynamo breaks the frame at the hook calls in ``nn.Module._call_impl``,
  before and after ``forward``, never inside it) and gather every group
  its subtree uses, so the graph sees whole parameters: the same Parameter
  objects with the same shapes at every step. Only their storage changes
  from step to step, which Dynamo does not guard on;
- the modules inside it lose their hooks: the unit's graph has no break
  for them, and no guard on them (a hook's arguments would make each
  block's graph its own).
A compiled module that is no unit (the model itself, inside
``torch.compile(engine)``) still trains exactly: every hook then runs
outside the graph, which Dynamo breaks at each hooked module.
The engine adopts compiled modules before each forward, so a module
compiled after ``zcore.initialize`` becomes a unit too. Compiling the whole
model would make one unit that gathers every parameter at once, so at
stage 3 ``torch.compile(model)`` is taken apart at ``zcore.initialize``: the
model's blocks are compiled instead, with the same options
(``unwrap_compiled``), and ``engine.compile()`` compiles the blocks too.
Stages 0-2 hook no module: the model compiles as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Callable

from torch import nn

from zcore.engine import hooks
from zcore.errors import InvalidArgumentError
from zcore.zero3.param_fetcher import ParamFetcher

try:
    from torch._dynamo.eval_frame import OptimizedModule
except ImportError:  # a torch built without Dynamo compiles nothing
    OptimizedModule = ()

# What cannot run over parameters whose storage changes between steps:
# CUDA graphs replay fixed addresses.
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module``'s calls run compiled."""
    return isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the modules with parameters in its
    outermost ``nn.ModuleList``s and ``nn.ModuleDict``s."""
    found: list[nn.Module] = []
    pending = [model]
    while pending:
        module = pending.pop(0)
        for child in module.children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                found.extend(b for b in child.children() if next(b.parameters(), None) is not None)
            else:
                pending.append(child)
    return found


def compile_blocks(model: nn.Module, compile_block: Callable[[nn.Module], None], asked: str) -> None:
    """``compile_block(block)`` for each of the model's blocks; ``asked``
    (how the user asked to compile) names the request in the error."""
    blocks = blocks_of(model)
    if not blocks:
        raise InvalidArgumentError(
            f"{asked} at ZeRO stage 3 compiles the model's blocks, the modules of its nn.ModuleList "
            f"or nn.ModuleDict, one unit each, but {type(model).__name__} has none with parameters: "
            "compile the modules to gather as one unit yourself (module.compile()) before or after "
            "zcore.initialize"
        )
    for block in blocks:
        compile_block(block)


def check_compile_options(backend: object, options: dict) -> None:
    """Stage 3: refuses what cannot run over gathered parameters."""
    if options.get("fullgraph"):
        raise InvalidArgumentError(
            "fullgraph=True at ZeRO stage 3: zcore gathers a block's parameters in hooks that run "
            "outside its graph, so Dynamo breaks each compiled block's call before and after its "
            "forward (never inside it); leave fullgraph out, or compile torch.compile(block, "
            "fullgraph=True) and put it in the block's place before zcore.initialize"
        )
    if options.get("mode") in _CUDA_GRAPH_MODES or backend == "cudagraphs" or (options.get("options") or {}).get(
        "triton.cudagraphs"
    ):
        raise InvalidArgumentError(
            f"torch.compile with CUDA graphs (mode={options.get('mode')!r}, backend={backend!r}) at ZeRO "
            "stage 3: a graph replays fixed addresses, but gathered parameters live in different "
            "memory at each use; use the default mode"
        )


def unwrap_compiled(model: nn.Module, shards_parameters: bool) -> nn.Module:
    """The module zcore trains: ``torch.compile(model)``'s own model, so that
    its parameters keep their names (no ``_orig_mod.`` in checkpoints and
    state dicts, which then load into the model compiled or not), compiled
    with the same options: whole, as ``model.compile()`` does, at stages
    0-2; at stage 3 block by block instead (note "compiled units"). Any
    other model as it is. A model compiled by ``model.compile()`` is
    refused at stage 3: its options cannot be read back."""
    if shards_parameters and getattr(model, "_compiled_call_impl", None) is not None:
        raise InvalidArgumentError(
            "model.compile() compiles the whole model, whose ZeRO-3 hooks would then gather every "
            "parameter at once: compile each block instead (block.compile() for the blocks), pass "
            "torch.compile(model), or call engine.compile() after zcore.initialize"
        )
    if not isinstance(model, OptimizedModule):
        return model
    inner, compile_with = model._orig_mod, model.dynamo_ctx

    def compile_module(module: nn.Module) -> None:
        # What module.compile(...) does, with torch.compile(model)'s options.
        module._compiled_call_impl = compile_with(module._call_impl)

    if shards_parameters:
        compile_blocks(inner, compile_module, "torch.compile(model)")
    else:
        compile_module(inner)
    return inner


def has_compiled(model: nn.Module) -> bool:
    """Whether ``model`` or a module inside it runs compiled."""
    return is_compiled(model) or next(_outermost_compiled(model), None) is not None


def _outermost_compiled(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        if is_compiled(child):
            yield child
        else:
            yield from _outermost_compiled(child)


class CompiledUnits:
    """Stage 3: the model's compiled modules, hooked as units."""

    def __init__(self, model: nn.Module, fetcher: ParamFetcher, handles: list) -> None:
        """``handles``: the engine's hook handles, which the units' join."""
        self._model = model
        self._fetcher = fetcher
        self._handles = handles
        self._adopted: set[int] = set()  # id(module)

    def adopt(self) -> None:
        """Before a forward: the compiled modules not yet units become units."""
        for module in _outermost_compiled(self._model):
            if id(module) not in self._adopted:
                k, inside = self._fetcher.add_unit(module)
                self._handles += hooks.register_unit_hooks(self._fetcher, k, module, inside)
                self._adopted.add(id(module))
