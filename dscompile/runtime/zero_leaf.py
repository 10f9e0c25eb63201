"""ZeRO-3 leaf modules: modules whose parameters are gathered together, as one unit (DeepSpeed's ``set_z3_leaf_modules``).

DeepSpeed's ZeRO-3 fetches parameters from module hooks in the order it traced; a Mixture-of-Experts block calls its
experts in a data-dependent order, so DeepSpeed lets users flag the block as a *leaf*: entering it fetches every
parameter under it at once. dscompile's ZeRO-3 places its gathers from the compiled graph (the order is the graph's,
whatever the routing), so the flag is not needed for correctness here; it changes the schedule the same way: the
``zero`` pass puts a leaf's gathers together before the first use of any of them, and ``zero_bucketing`` issues them
as one all-gather whatever the bucket limits (``docs/zero.md``, "Leaf modules").

The flag is ``module._z3_leaf`` and a partitioned leaf parameter carries ``ds_z3_leaf_module``, as in DeepSpeed, so
code written against DeepSpeed's helpers reads the same attributes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from torch import nn

log = logging.getLogger("dscompile.zero")

DEFAULT_LEAF_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
"""DeepSpeed 0.19.8's ``zero_optimization.leaf_module.classes`` default: the Hugging Face sparse MoE blocks."""


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether ``module`` is flagged as a ZeRO-3 leaf."""
    return bool(getattr(module, "_z3_leaf", False))


def z3_leaf_parameter(param: nn.Parameter) -> bool:
    """Whether ``param`` was partitioned as part of a leaf module (it carries ``ds_z3_leaf_module``)."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` flagged as leaves."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Flag (or unflag) one module."""
    model._z3_leaf = flag  # type: ignore[assignment]


def _qualified_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(module: nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    return type(module).__name__ == wanted or _qualified_name(module) == wanted


def _set_by_class(model: nn.Module, classes: Sequence[type | str], flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    if isinstance(classes, (str, type)) or not all(isinstance(c, (type, str)) for c in classes):
        raise TypeError(f"leaf_module_classes must be a list of module classes or class names, got {classes!r}")
    found: list[nn.Module] = []
    model.apply(lambda m: found.append(m) if any(_matches(m, c) for c in classes) else None)  # DeepSpeed's order: children first
    for module in found:
        set_z3_leaf_module(module, flag)
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {list(classes)} found in model {type(model).__name__}")
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True) -> list[nn.Module]:
    """Flag every module of ``model`` that is an instance of one of ``leaf_module_classes`` (classes, or class names
    plain or fully qualified); returns them. Call it before ``initialize``: the partition reads the flags."""
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True) -> list[nn.Module]:
    """Clear the leaf flag of the matching modules; returns them."""
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def _set_by_names(
    model: nn.Module, names: Iterable[str], flag: bool, raise_if_not_found: bool, suffix: bool
) -> tuple[list[nn.Module], list[str]]:
    named = dict(model.named_modules())
    found: dict[int, nn.Module] = {}
    missing = []
    for wanted in names:
        hits = [m for n, m in named.items() if (n.endswith(wanted) if suffix else n == wanted)]
        if not hits:
            missing.append(wanted)
        for module in hits:
            set_z3_leaf_module(module, flag)
            found.setdefault(id(module), module)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules {'matching suffixes' if suffix else 'named'} {missing} found in model {type(model).__name__}")
    return list(found.values()), missing


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names: Iterable[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules named (as ``named_modules()`` names them); returns them and the names not found."""
    return _set_by_names(model, module_names, flag, raise_if_not_found, suffix=False)


def set_z3_leaf_modules_by_suffix(
    model: nn.Module, module_name_suffixes: Iterable[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules whose ``named_modules()`` name ends with one of the suffixes; returns them and the suffixes
    that matched nothing."""
    return _set_by_names(model, module_name_suffixes, flag, raise_if_not_found, suffix=True)


@dataclass
class LeafModuleConfig:
    """``zero_optimization.leaf_module``: which modules the engine flags as leaves before partitioning (DeepSpeed's
    defaults: the Hugging Face sparse MoE blocks, by class)."""

    classes: list[str] = field(default_factory=lambda: list(DEFAULT_LEAF_CLASSES))
    names: list[str] = field(default_factory=list)
    name_suffixes: list[str] = field(default_factory=list)


def apply_leaf_module_config(model: nn.Module, config: LeafModuleConfig) -> list[nn.Module]:
    """Flag the modules ``config`` names (nothing found is fine: the defaults name classes most models lack); a
    name or suffix the user gave that matches nothing is logged. Returns the flagged modules."""
    found: dict[int, nn.Module] = {}
    for module in _set_by_class(model, config.classes, True, raise_if_not_found=False) if config.classes else []:
        found.setdefault(id(module), module)
    for what, wanted, suffix in (("names", config.names, False), ("name_suffixes", config.name_suffixes, True)):
        modules, missing = _set_by_names(model, wanted, True, raise_if_not_found=False, suffix=suffix)
        if missing:
            log.warning("zero_optimization.leaf_module.%s: %s match no module of the model", what, missing)
        for module in modules:
            found.setdefault(id(module), module)
    return list(found.values())


def leaf_of_parameters(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """Parameter name -> (name of its outermost leaf module, the module), for the parameters under a leaf."""
    owners: dict[str, tuple[str, nn.Module]] = {}
    for prefix, module in model.named_modules():  # outer modules come first: a leaf inside a leaf joins the outer one
        if z3_leaf_module(module):
            for name, _ in module.named_parameters(prefix=prefix):
                owners.setdefault(name, (prefix, module))
    return owners
