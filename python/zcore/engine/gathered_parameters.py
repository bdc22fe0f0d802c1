"""Full parameters on demand, outside the module hooks (ZeRO-3).

``GatheredParameters(params)`` gathers the groups that hold ``params`` for
the duration of a ``with`` block (read them, save them); with
``modifier_rank=r``, rank r's values at the end of the block are broadcast
and written into every rank's shard and fp32 master. Parameters that zcore
does not shard (stages 0-2, or not given to zcore.initialize) are whole
already: the block then does nothing.

``register_external_parameter(module, param)``: ``module`` uses ``param``
although another module owns it, so the param's group is gathered whenever
``module`` runs. Call it before or after zcore.initialize. A parameter that
a module returns to its caller needs no call: zcore declares it (note
"external parameters" in zcore.zero3.external_params).
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional, Union

import torch

from zcore.engine import hooks
from zcore.zero3.param_fetcher import ParamFetcher

# Fetchers alive in this process, to find the one that shards a parameter.
_FETCHERS: "weakref.WeakSet[ParamFetcher]" = weakref.WeakSet()
# Registrations made before zcore.initialize, taken when it hooks the module.
_PENDING: "weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Parameter]]" = (
    weakref.WeakKeyDictionary()
)


def track(fetcher: ParamFetcher) -> None:
    _FETCHERS.add(fetcher)


def pending_external(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return _PENDING.pop(module, [])


def _fetcher_of(params: list[torch.nn.Parameter]) -> Optional[ParamFetcher]:
    for fetcher in _FETCHERS:
        if any(id(p) in fetcher.group_of_param for p in params):
            return fetcher
    return None


class GatheredParameters:
    """A ``with`` block in which ``params`` are whole on every rank (ZeRO-3:
    their groups are gathered for the block). With ``modifier_rank=r``, rank
    r's values at the end of the block are broadcast and written into every
    rank's shard and fp32 master weights. Parameters zcore does not shard are
    whole already, and the block does nothing for them."""

    def __init__(
        self,
        params: Union[torch.nn.Parameter, Iterable[torch.nn.Parameter]],
        modifier_rank: Optional[int] = None,
    ) -> None:
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self._fetcher = _fetcher_of(self.params)
        self._site: Optional[int] = None
        self._groups: list[int] = []

    def __enter__(self) -> list[torch.nn.Parameter]:
        fetcher = self._fetcher
        if fetcher is not None:
            self._groups = sorted(
                {fetcher.group_of_param[id(p)] for p in self.params if id(p) in fetcher.group_of_param}
            )
            self._site = fetcher.site_for(self._groups)
            fetcher.gather_site(self._site)
        return self.params

    def __exit__(self, exc_type, exc, tb) -> None:
        fetcher = self._fetcher
        if fetcher is None:
            return
        try:
            if self.modifier_rank is not None and exc_type is None:
                with torch.no_grad():
                    for group in self._groups:
                        fetcher.write_back(group, self.modifier_rank)
        finally:
            fetcher.release_site(self._site)


def register_external_parameter(module: torch.nn.Module, param: torch.nn.Parameter) -> None:
    """``module`` uses ``param`` although another module owns it: ZeRO-3
    gathers ``param``'s group whenever ``module`` runs. Call it before or
    after ``zcore.initialize``."""
    fetcher = _fetcher_of([param])
    if fetcher is None:
        _PENDING.setdefault(module, []).append(param)
        return
    add_external(fetcher, module, param)


def add_external(fetcher: ParamFetcher, module: torch.nn.Module, param: torch.nn.Parameter) -> None:
    group = fetcher.group_of_param[id(param)]
    k = fetcher.module_index(module)
    if k is None:
        k = fetcher.add_module(module, [group])
        hooks.register_module_hooks(fetcher, {k: module})
    else:
        fetcher.add_to_module(k, group)
