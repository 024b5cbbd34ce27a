"""The key grammar of optimizer state dicts, nested and flattened, spelled in this one place.

Nested (``optimizer.state_dict()``, ``get_optimizer_state_dict``): ``{"state": {name: {key: value}},
"param_groups": [{..., "params": [name, ...]}]}``. Flattened (``flatten_optimizer_state_dict=True``, as
torchtitan saves): one mapping whose keys are ``state.<name>.<key>`` and ``param_groups.<name>.<hp>``. A
parameter's name may hold dots; a state key or hyperparameter (the leaf) never does. DCP joins a key
path with dots too (``dotted``), so a flattened DCP key reads the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

Section = Literal["state", "param_groups"]
STATE: Section = "state"
PARAM_GROUPS: Section = "param_groups"
SECTIONS: tuple[Section, Section] = (STATE, PARAM_GROUPS)
FLAT_PREFIXES = (f"{STATE}.", f"{PARAM_GROUPS}.")


def is_nested(optimizer: Mapping[Any, Any]) -> bool:
    """Whether an optimizer state dict is nested (has ``state`` and ``param_groups``), not flattened."""
    return STATE in optimizer and PARAM_GROUPS in optimizer


def flat_key(section: Section, name: object, leaf: str) -> str:
    """The flattened key of ``leaf`` (a state key or hyperparameter) of parameter ``name``."""
    return f"{section}.{name}.{leaf}"


def section_of(key: str) -> Section | None:
    """The section a flattened key belongs to, or None for a key of neither."""
    if key.startswith(FLAT_PREFIXES[0]):
        return STATE
    if key.startswith(FLAT_PREFIXES[1]):
        return PARAM_GROUPS
    return None


def split_flat(key: str) -> tuple[Section, str, str]:
    """A flattened key's section, parameter name and leaf (split at the last dot: the leaf holds none)."""
    section = section_of(key)
    if section is None:
        raise ValueError(f"{key!r} is no flattened optimizer key")
    name, _, leaf = key[len(section) + 1 :].rpartition(".")
    return section, name, leaf


def leaf_of(key: str, section: Section, name: object) -> str | None:
    """The leaf of ``key`` when it is ``<section>.<name>.<leaf>``, else None (``state.<name>.x.y`` is not)."""
    prefix = f"{section}.{name}."
    if key.startswith(prefix) and "." not in key[len(prefix) :]:
        return key[len(prefix) :]
    return None


def renamed_flat(key: str, mapping: Mapping[Any, Any]) -> str | None:
    """``key`` with its parameter renamed by ``mapping`` (a name mapped to None is dropped: None)."""
    section, name, leaf = split_flat(key)
    new = mapping.get(name, name)
    return None if new is None else flat_key(section, new, leaf)


def dotted(parts: Iterable[object]) -> str:
    """A key path as DCP flattens it into a metadata key: its parts joined by dots."""
    return ".".join(str(part) for part in parts)


_LEADING_WRAPPERS = frozenset({"module", "_orig_mod"})
"""What DDP (``module``) and ``torch.compile`` (``_orig_mod``) put before the wrapped model's names."""
_WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
"""What FSDP1 and activation checkpointing put between a module and the one they wrap."""


def unwrapped(name: str) -> str:
    """A parameter name without what torch's wrappers insert, as torch's ``state_dict._get_fqns`` strips them:
    ``module.`` (DDP) and ``_orig_mod.`` (``torch.compile``) before the name, ``_fsdp_wrapped_module.`` and
    ``_checkpoint_wrapped_module.`` anywhere. ``get_optimizer_state_dict`` keys the optimizer by these names
    while ``model.state_dict()`` of the wrapper keeps the wrapped ones."""
    parts = [part for part in name.split(".") if part not in _WRAPPER_PARTS]
    start = 0
    while start < len(parts) - 1 and parts[start] in _LEADING_WRAPPERS:
        start += 1
    return ".".join(parts[start:])
