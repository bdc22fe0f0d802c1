"""ZeRO-3 use sites: the coordinator modules that Python enters and leaves,
and the names that errors and logs give them.

A use site is one native coordinator module (zcore._C.ParamCoordinator's
``register_module``): the groups that must be gathered while it is in use.
Each hooked module has one, replaced by a larger one when it takes over an
external parameter (note "external parameters" in zcore.zero3.external_params);
GatheredParameters gets one per set of groups.
"""

from __future__ import annotations

from typing import Optional

import torch

import zcore._C as _C
from zcore.zero3.sharded_group import ShardedGroup


class ModelNames:
    """How errors and logs name the model's modules and parameters."""

    def __init__(self, model: torch.nn.Module, groups: list[ShardedGroup], group_of_param: dict[int, int]) -> None:
        self._groups = groups
        self._group_of_param = group_of_param
        self._modules = {id(m): name for name, m in model.named_modules()}
        self._params = {id(p): name for name, p in model.named_parameters()}

    def module(self, module: torch.nn.Module) -> str:
        name = self._modules.get(id(module))
        if name is None:
            return f"a {type(module).__name__} outside the model"
        return f"module '{name}' ({type(module).__name__})" if name else f"the model ({type(module).__name__})"

    def param(self, param: torch.Tensor) -> str:
        g = self._groups[self._group_of_param[id(param)]]
        shape = next(s for p, s in zip(g.params, g.shapes) if p is param)
        return f"'{self._params.get(id(param), '?')}' (shape {tuple(shape)})"

    def params_of(self, group: int) -> str:
        return ", ".join(f"'{self._params.get(id(p), '?')}'" for p in self._groups[group].params)

    def shapes_of(self, group: int) -> str:
        return ", ".join(str(tuple(s)) for s in self._groups[group].shapes)


class UseSites:
    """The hooked modules (index k), the coordinator module each uses now,
    and the sites of other uses (GatheredParameters), each with its name."""

    def __init__(self, coordinator: _C.ParamCoordinator, names: ModelNames) -> None:
        self._coordinator = coordinator
        self._names = names
        self.modules: list[torch.nn.Module] = []  # hooked module k
        self._site: list[int] = []  # hooked module k -> its coordinator module
        self._index: dict[int, int] = {}  # id(module) -> k
        self._name: dict[int, str] = {}  # coordinator module -> what it is, for errors
        self._of_groups: dict[tuple[int, ...], int] = {}

    def site(self, k: int) -> int:
        return self._site[k]

    def name(self, site: int) -> str:
        return self._name[site]

    def groups(self, site: int) -> list[int]:
        return self._coordinator.module_groups(site)

    def index(self, module: torch.nn.Module) -> Optional[int]:
        return self._index.get(id(module))

    def add_module(self, module: torch.nn.Module, group_ids: list[int]) -> int:
        """A module to hook, needing ``group_ids``; returns its index k."""
        self._index[id(module)] = len(self._site)
        self.modules.append(module)
        self._site.append(self._register(group_ids, self._names.module(module)))
        return len(self._site) - 1

    def add_to_module(self, k: int, group: int) -> None:
        """Hooked module ``k`` also needs ``group`` from now on."""
        groups = list(self.groups(self._site[k]))
        if group not in groups:
            self._site[k] = self._register(groups + [group], self._name[self._site[k]])

    def remove_from_module(self, k: int, group: int) -> None:
        """Hooked module ``k`` no longer needs ``group``."""
        groups = list(self.groups(self._site[k]))
        if group in groups:
            self._site[k] = self._register([g for g in groups if g != group], self._name[self._site[k]])

    def for_groups(self, group_ids: list[int]) -> int:
        """The site of a use of exactly these groups (made on first request)."""
        key = tuple(sorted(set(group_ids)))
        if key not in self._of_groups:
            self._of_groups[key] = self._register(list(key), f"a use of groups {list(key)}")
        return self._of_groups[key]

    def _register(self, group_ids: list[int], name: str) -> int:
        site = self._coordinator.register_module(group_ids)
        self._name[site] = name
        return site
