"""What the config names by ``_target_`` for a user's own code (``model._target_``,
``trainer.step._target_``, ``loader.collate_fn._target_``): imported, and the keys given for
it checked against its signature before anything runs, each mistake named with its key.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from hydra.utils import get_object

from feedrate.errors import ConfigError

META = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")  # Hydra's, not arguments


def load(key: str, target: Any) -> Callable:
    """The class or function ``key._target_`` names, or a ConfigError that says why not."""
    if not target or str(target) == "???":
        raise ConfigError(
            f"{key}._target_ is not set: name your class or function by its import path,"
            f" e.g. {key}._target_=my_pkg.module.Name"
        )
    try:
        obj = get_object(str(target))
    except Exception as exc:  # ImportError, AttributeError, ValueError: Hydra says which
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(
            f"{key}._target_={target} cannot be imported ({why}): check the spelling, and that"
            " its package is importable from where you run (the current directory, the"
            " PYTHONPATH, or pip install -e)"
        ) from None
    if not callable(obj):
        raise ConfigError(
            f"{key}._target_={target} is a {type(obj).__name__}, not a class or function"
        )
    return obj


def _signature(obj: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without one: nothing to check against
        return None


def accepts(obj: Callable, name: str) -> bool:
    """Whether ``obj`` takes a keyword argument ``name`` (by name, or through ``**kwargs``)."""
    sig = _signature(obj)
    if sig is None:
        return False
    params = sig.parameters.values()
    return name in sig.parameters or any(p.kind is p.VAR_KEYWORD for p in params)


def arguments(obj: Callable) -> list[str]:
    """The names ``obj`` takes by keyword, in order (``**kwargs`` shown as such)."""
    sig = _signature(obj)
    if sig is None:
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = [p.name for p in sig.parameters.values() if p.kind in kinds]
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        named.append("**kwargs")
    return named


def check_keys(key: str, target: str, obj: Callable, given: Iterable[str], fix: str = "") -> None:
    """Every key in ``given`` is an argument of ``obj``; else a ConfigError naming the first
    that is not, what ``obj`` does take, and how to drop it."""
    sig = _signature(obj)
    if sig is None or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return
    for name in given:
        if name in META or name in sig.parameters:
            continue
        takes = ", ".join(arguments(obj)) or "no keyword arguments"
        raise ConfigError(
            f"{key}.{name} is not an argument of {target}, which takes: {takes}."
            f" Fix the key, or drop it ('~{key}.{name}' on the command line){fix}"
        )


def missing(obj: Callable, given: Iterable[str]) -> list[str]:
    """Required arguments of ``obj`` that neither ``given`` nor a default fills."""
    sig = _signature(obj)
    if sig is None:
        return []
    have = set(given)
    return [
        p.name
        for p in sig.parameters.values()
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in have
    ]
