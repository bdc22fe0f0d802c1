"""Full parameters on demand, outside the module hooks (ZeRO-3).

``GatheredParameters(params)`` gathers the groups that hold ``params`` for
the duration of a ``with`` block (read them, save them); with
``modifier_rank=r``, rank r's values at the end of the block are broadcast
and written into every rank's shard and fp32 master. Parameters that zcore
does not shard (stages 0-2, or not given to zcore.initialize) are whole
already: the block then does nothing.

``register_external_parameter(module, param)``: ``module`` uses ``param``
although another module owns it, so the param's group is gathered whenever
``module`` runs. Call it before or after zcore.initialize;
``unregister_external_parameter`` undoes it. A parameter that a module
returns to its caller needs no call: zcore declares it (note "external
parameters" in zcore.zero3.external_params).
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional, Union

import torch

from zcore.checkpoint.async_save import finish_copies
from zcore.engine import hooks
from zcore.errors import InvalidArgumentError, InvalidStateError
from zcore.zero3.leaf_modules import z3_leaf_module
from zcore.zero3.param_fetcher import ParamFetcher

# Fetchers alive in this process, to find the one that shards a parameter.
_FETCHERS: "weakref.WeakSet[ParamFetcher]" = weakref.WeakSet()
# Registrations made before zcore.initialize, taken when it hooks the module.
_PENDING: "weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Parameter]]" = (
    weakref.WeakKeyDictionary()
)
# Every registration in force, pending or taken: what unregistering may undo.
_REGISTERED: "weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Parameter]]" = (
    weakref.WeakKeyDictionary()
)


def track(fetcher: ParamFetcher) -> None:
    _FETCHERS.add(fetcher)


def pending_external(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return _PENDING.pop(module, [])


def _fetcher_of(params: list[torch.nn.Parameter]) -> Optional[ParamFetcher]:
    """The fetcher sharding the first of ``params`` it shards any of."""
    return next(iter(_fetchers_of(params)), None)


def _fetchers_of(params: list[torch.nn.Parameter]) -> list[ParamFetcher]:
    """Every fetcher sharding some of ``params`` (one per engine), in a
    fixed order: by the first of ``params`` each holds, the same on every rank."""
    found = [(next(i for i, p in enumerate(params) if id(p) in f.group_of_param), f) for f in _FETCHERS
             if any(id(p) in f.group_of_param for p in params)]
    return [f for _, f in sorted(found, key=lambda pair: pair[0])]


class GatheredParameters:
    """A ``with`` block in which ``params`` are whole on every rank (ZeRO-3:
    their groups are gathered for the block). With ``modifier_rank=r``, rank
    r's values at the end of the block are broadcast and written into every
    rank's shard and fp32 master weights. Parameters zcore does not shard are
    whole already, and the block does nothing for them. DeepSpeed's
    arguments: ``fwd_module``, a module whose forward uses ``params`` (they
    are registered as its external parameters, see
    ``register_external_parameter``); ``enabled=False``, a block that does
    nothing. Parameters still on the meta device (built under
    ``zcore.zero.Init``, not yet given to ``zcore.initialize``) have no
    values to gather: they are refused."""

    def __init__(
        self,
        params: Union[torch.nn.Parameter, Iterable[torch.nn.Parameter]],
        modifier_rank: Optional[int] = None,
        fwd_module: Optional[torch.nn.Module] = None,
        enabled: bool = True,
    ) -> None:
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        # Parameters of several engines (each its own fetcher) are gathered by each.
        self._fetchers = _fetchers_of(self.params) if enabled else []
        self._entered: list[tuple[ParamFetcher, list[int], int]] = []  # (fetcher, groups, site) gathered
        if not enabled:
            return
        if not self._fetchers and any(p.is_meta for p in self.params):
            raise InvalidStateError(
                "GatheredParameters was given parameters on the meta device (built under zcore.zero.Init "
                "or torch.device('meta')), which have no values until zcore.initialize materialises them "
                "into shards: enter the block after zcore.initialize, or give the values at construction "
                "with zcore.initialize(..., meta_init=zcore.MetaInit(init_fn=...))"
            )
        if fwd_module is not None:
            for p in self.params:
                register_external_parameter(fwd_module, p)

    def __enter__(self) -> list[torch.nn.Parameter]:
        try:
            for fetcher in self._fetchers:
                groups = sorted({fetcher.group_of_param[id(p)] for p in self.params if id(p) in fetcher.group_of_param})
                site = fetcher.site_for(groups)
                fetcher.gather_site(site)
                self._entered.append((fetcher, groups, site))
        except BaseException:
            self._release()
            raise
        return self.params

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.modifier_rank is not None and exc_type is None and self._entered:
                finish_copies()  # an asynchronous save may still be copying the shards written here
                with torch.no_grad():
                    for fetcher, groups, _ in self._entered:
                        for group in groups:
                            fetcher.write_back(group, self.modifier_rank)
        finally:
            self._release()

    def _release(self) -> None:
        """Every gathered site is released, even where one release fails (the first failure is raised)."""
        failure: Optional[BaseException] = None
        for fetcher, _, site in reversed(self._entered):
            try:
                fetcher.release_site(site)
            except BaseException as exc:  # noqa: BLE001 - raised below, once every site is released
                failure = failure or exc
        self._entered = []
        if failure is not None:
            raise failure


def register_external_parameter(module: torch.nn.Module, param: torch.nn.Parameter) -> None:
    """``module`` uses ``param`` although another module owns it: ZeRO-3
    gathers ``param``'s group whenever ``module`` runs. Call it before or
    after ``zcore.initialize``."""
    _check_parameter(param, "register_external_parameter")
    _REGISTERED.setdefault(module, []).append(param)
    fetcher = _fetcher_of([param])
    if fetcher is None:
        _PENDING.setdefault(module, []).append(param)
        return
    add_external(fetcher, module, param)


def unregister_external_parameter(module: torch.nn.Module, param: torch.nn.Parameter) -> None:
    """Undoes ``register_external_parameter(module, param)``: ``param``'s
    group is no longer gathered for ``module`` (unless the module owns, or
    still declares, another parameter of that group)."""
    _check_parameter(param, "unregister_external_parameter")
    registered = _REGISTERED.get(module, [])
    if not any(p is param for p in registered):
        raise InvalidArgumentError(
            f"unregister_external_parameter: the parameter (shape {tuple(param.shape)}) is not a registered "
            f"external parameter of this {type(module).__name__}; register_external_parameter(module, param) "
            "declares one",
            argument="parameter",
        )
    _REGISTERED[module] = remaining = [p for p in registered if p is not param]
    pending = _PENDING.get(module)
    if pending is not None and any(p is param for p in pending):
        _PENDING[module] = [p for p in pending if p is not param]
        return
    fetcher = _fetcher_of([param])
    k = None if fetcher is None else fetcher.module_index(module)
    if fetcher is None or k is None:
        return
    group = fetcher.group_of_param[id(param)]
    # A leaf module needs its subtree's parameters, others their direct ones (zcore.zero3.sharded_group).
    own = module.parameters(recurse=z3_leaf_module(module))
    if all(fetcher.group_of_param.get(id(p)) != group for p in [*own, *remaining]):
        fetcher.remove_from_module(k, group)


def _check_parameter(param: object, caller: str) -> None:
    if not isinstance(param, torch.nn.Parameter):
        raise InvalidArgumentError(
            f"{caller} takes a torch.nn.Parameter, got a {type(param).__name__}", argument="parameter"
        )


def add_external(fetcher: ParamFetcher, module: torch.nn.Module, param: torch.nn.Parameter) -> None:
    group = fetcher.group_of_param[id(param)]
    k = fetcher.module_index(module)
    if k is None:
        k = fetcher.add_module(module, [])
        hooks.register_module_hooks(fetcher, {k: module})
        fetcher.add_to_module(k, group, hooked_now=True)
    else:
        fetcher.add_to_module(k, group)
