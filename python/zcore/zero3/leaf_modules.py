"""ZeRO-3 leaf modules: a module subtree gathered as one unit (DeepSpeed's
``set_z3_leaf_modules`` and its companions, under the same names).

A leaf module is hooked as one module whose groups are those of every
parameter in its subtree; the modules inside it are not hooked. Entering
it gathers all of them, and they are released when its forward returns and
again after its backward, as a unit. What runs inside (which experts of a
mixture-of-experts layer a rank's tokens reach) may then differ between
ranks: every rank gathers the same groups when it enters the leaf, so the
collectives match. The groups themselves stay one per module (note in
zcore.zero3.sharded_group), so marking a module changes no shard layout and
no checkpoint.

Marks are zcore's own (a weak set of modules), not attributes on the
modules; they are read when ``zcore.initialize`` hooks the model, so marking
after it changes nothing for that engine. DeepSpeed's config section
``zero_optimization.leaf_module`` marks modules by class, name and name
suffix there (``apply_leaf_module_config``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import Optional, Union

import torch

from zcore.config.leaf_modules import LeafModuleConfig
from zcore.errors import InvalidArgumentError

log = logging.getLogger("zcore")

ModuleClasses = Iterable[Union[type, str]]

_LEAVES: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def z3_leaf_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is marked as a ZeRO-3 leaf."""
    return module in _LEAVES


def z3_leaf_parameter(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` belongs to a module marked as a leaf (to its subtree)."""
    return any(any(p is param for p in leaf.parameters()) for leaf in list(_LEAVES))


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` (itself included) marked as leaves, in ``modules()`` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes: ModuleClasses, raise_if_not_found: bool = True
) -> list[torch.nn.Module]:
    """Marks every module of ``model`` (itself included) that is an instance
    of one of ``leaf_module_classes`` (classes; or names, either the class's
    ``__name__`` or its fully qualified ``module.QualName``) as a ZeRO-3
    leaf: entered, it gathers its whole subtree's parameters at once, so
    what runs inside may differ from rank to rank (mixture-of-experts
    routing). Returns the modules marked; none found raises
    InvalidArgumentError (a ValueError) unless ``raise_if_not_found`` is
    False. Call it before ``zcore.initialize``."""
    return _mark_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes: ModuleClasses, raise_if_not_found: bool = True
) -> list[torch.nn.Module]:
    """Removes the leaf mark from the modules ``set_z3_leaf_modules`` with
    these classes would mark; returns them."""
    return _mark_classes(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: torch.nn.Module, module_names: Iterable[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[torch.nn.Module], list[str]]:
    """Marks (``flag`` True) or unmarks the modules named ``module_names``
    in ``model.named_modules()``; returns (the modules, the names not found)."""
    by_name = dict(model.named_modules())
    names = list(module_names)
    found = [by_name[n] for n in names if n in by_name]
    missing = [n for n in names if n not in by_name]
    if missing and raise_if_not_found:
        raise InvalidArgumentError(
            f"no modules named {missing} in the model (a {type(model).__name__}); give names as "
            "model.named_modules() lists them, or pass raise_if_not_found=False",
            missing=missing,
        )
    _mark(found, flag)
    return found, missing


def set_z3_leaf_modules_by_suffix(
    model: torch.nn.Module,
    module_name_suffixes: Iterable[str],
    flag: bool = True,
    raise_if_not_found: bool = True,
) -> tuple[list[torch.nn.Module], list[str]]:
    """Marks (``flag`` True) or unmarks the modules whose names in
    ``model.named_modules()`` end with one of ``module_name_suffixes``;
    returns (the modules, the suffixes that matched none)."""
    found: dict[int, torch.nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        matched = [m for name, m in model.named_modules() if name.endswith(suffix)]
        if not matched:
            missing.append(suffix)
        found.update((id(m), m) for m in matched)
    if missing and raise_if_not_found:
        raise InvalidArgumentError(
            f"no module names in the model (a {type(model).__name__}) end with {missing}; "
            "check the names model.named_modules() lists, or pass raise_if_not_found=False",
            missing=missing,
        )
    _mark(found.values(), flag)
    return list(found.values()), missing


def apply_leaf_module_config(model: torch.nn.Module, config: Optional[LeafModuleConfig]) -> list[torch.nn.Module]:
    """Marks the leaves the config section names (as DeepSpeed does at
    initialize): by class, by name, by name suffix; entries that match
    nothing are logged where they are not the defaults."""
    if config is None:
        return []
    marked: dict[int, torch.nn.Module] = {}
    marked.update((id(m), m) for m in _mark_classes(model, config.classes, True, raise_if_not_found=False))
    by_name, missing_names = set_z3_leaf_modules_by_name(model, config.names, raise_if_not_found=False)
    by_suffix, missing_suffixes = set_z3_leaf_modules_by_suffix(model, config.name_suffixes, raise_if_not_found=False)
    marked.update((id(m), m) for m in by_name + by_suffix)
    if missing_names:
        log.warning("zcore: zero_optimization.leaf_module.names %s name no module of the model", missing_names)
    if missing_suffixes:
        log.warning(
            "zcore: zero_optimization.leaf_module.name_suffixes %s end no module name of the model", missing_suffixes
        )
    if not marked and config.customised:
        log.warning("zcore: zero_optimization.leaf_module matched no module; every module is hooked as usual")
    return list(marked.values())


def _mark_classes(
    model: torch.nn.Module, classes: ModuleClasses, flag: bool, raise_if_not_found: bool
) -> list[torch.nn.Module]:
    wanted = list(classes)
    wrong = [c for c in wanted if not isinstance(c, (type, str))]
    if wrong:
        raise InvalidArgumentError(
            f"leaf_module_classes must hold module classes or class names, got {wrong!r}",
            argument="leaf_module_classes",
        )
    found = [m for m in model.modules() if any(_is_instance(m, c) for c in wanted)]
    if not found and raise_if_not_found:
        raise InvalidArgumentError(
            f"no modules of the classes {wanted} in the model (a {type(model).__name__}); name a class "
            "its modules are instances of (by the class, its __name__ or module.QualName), or pass "
            "raise_if_not_found=False",
            argument="leaf_module_classes",
        )
    _mark(found, flag)
    return found


def _is_instance(module: torch.nn.Module, cls: Union[type, str]) -> bool:
    if isinstance(cls, type):
        return isinstance(module, cls)
    own = type(module)
    return cls in (own.__name__, f"{own.__module__}.{own.__qualname__}")


def _mark(modules: Iterable[torch.nn.Module], flag: bool) -> None:
    for m in modules:
        if flag:
            _LEAVES.add(m)
        else:
            _LEAVES.discard(m)
