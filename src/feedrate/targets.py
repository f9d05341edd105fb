"""What the config names by ``_target_`` for a user's own code (``model._target_``,
``trainer.step._target_``, ``loader.collate_fn._target_``): imported, and the keys given for
it checked against its signature before anything runs, each mistake named with its key.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from omegaconf import OmegaConf

from feedrate.config import DEFAULT_COLLATE, DEFAULT_STEP
from feedrate.errors import ConfigError

META = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")  # Hydra's, not arguments
SHORT_FORMS = ("trainer.step", "loader.collate_fn")  # may be named in short: key=pkg.fn


def target_of(node: Any) -> str | None:
    """The import path a config node names: ``{_target_: pkg.fn, ...}``, or ``pkg.fn`` itself
    (``trainer.step=pkg.fn`` on the command line)."""
    if node is None:
        return None
    if isinstance(node, str):
        return node
    return str(node.get("_target_")) if node.get("_target_") else None


def keys_of(node: Any) -> dict:
    """The keyword arguments a config node gives its target (none for a bare import path)."""
    if not isinstance(node, Mapping) and not hasattr(node, "items"):
        return {}
    return {str(k): v for k, v in node.items() if k not in META}


def own_parts(cfg: Any) -> dict:
    """The training step and the collate function where the user named their own; the
    defaults are left out, so what was measured before they existed still matches."""
    parts = {}
    step = target_of((cfg.get("trainer") or {}).get("step"))
    if step and step != DEFAULT_STEP:
        parts["step"] = step
    collate = target_of((cfg.get("loader") or {}).get("collate_fn"))
    if collate and collate != DEFAULT_COLLATE:
        parts["collate_fn"] = collate
    return parts


def _locate(path: str) -> Any:
    """The object at ``path``: the longest importable module, then attributes. An import
    that fails inside the user's module (a missing dependency, a syntax error) is raised as
    it is, not taken for a wrong name."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and name.startswith(exc.name):
                continue  # this module is not there: a shorter one, then attributes
            raise
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                raise AttributeError(f"{obj.__name__ if i else name} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(f"no module named {parts[0]!r}")


def load(key: str, target: Any) -> Callable:
    """The class or function ``key._target_`` names, or a ConfigError that says why not."""
    if not target or str(target) == "???":
        raise ConfigError(
            f"{key}._target_ is not set: name your class or function by its import path,"
            f" e.g. {key}._target_=my_pkg.module.Name"
        )
    try:
        obj = _locate(str(target))
    except Exception as exc:  # noqa: BLE001 - the user's module, imported: any failure
        raise ConfigError(
            f"{key}._target_={target} cannot be imported ({type(exc).__name__}: {exc}):"
            " check the spelling, and that its package is importable from where you run"
            " (the current directory, the PYTHONPATH, or pip install -e)"
        ) from None
    if not callable(obj):
        raise ConfigError(
            f"{key}._target_={target} is a {type(obj).__name__}, not a class or function"
        )
    return obj


def bound(key: str, node: Any, call: str, passed: tuple[str, ...] = ()) -> Callable:
    """The function ``node`` names with its keys bound by keyword, or an instance of the
    class it names built from them; checked first: the keys against the signature, and that
    it can be called as the loop calls it, ``call`` (``step(model, batch)``: its leading
    arguments by position, then the ``passed`` ones by keyword where it names them), with
    nothing else left to give."""
    target = target_of(node)
    given = keys_of(node)
    if not target and given:  # `key=pkg.fn +key.k=v`: the keys replaced the short form
        raise ConfigError(_keys_without_target(key, given, "no _target_"))
    fn = load(key, target)
    check_keys(key, str(target), fn, given)
    if inspect.isclass(fn):
        need = missing(fn, given)
        if need:
            raise ConfigError(
                f"{key}._target_={target} needs {need[0]}, which the config does not give:"
                f" add it with +{key}.{need[0]}=<value>"
            )
        fn = fn(**given)  # its instance is called on each batch
        given = {}
    if not callable(fn):
        raise ConfigError(
            f"{key}._target_={target} is a class whose instances cannot be called: give it a"
            f" __call__ that takes what {call} passes"
        )
    wrong = _called_as(key, fn, call, given, passed)
    if wrong:
        raise ConfigError(f"{key}._target_={target} {wrong} (docs/custom.md)")
    return functools.partial(fn, **given) if given else fn


def check_short_forms(cfg: Any, overrides: Iterable[str]) -> None:
    """A key given for a part named in short (``trainer.step=pkg.fn``) that the short form
    replaced (``+trainer.step.k=v trainer.step=pkg.fn``: Hydra keeps the last): a
    ConfigError, not a run without it."""
    for key in SHORT_FORMS:
        node = OmegaConf.select(cfg, key)
        if not isinstance(node, str):
            continue
        names = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
        lost = [n.removeprefix(f"{key}.") for n in names if n.startswith(f"{key}.")]
        lost = [n for n in lost if n not in META]  # a target the short form names again
        if lost:
            raise ConfigError(_keys_without_target(key, lost, f"the short form {key}={node}"))


def _keys_without_target(key: str, names: Iterable[str], which: str) -> str:
    return (
        f"{key} is given keys ({', '.join(names)}) and {which}: with keys, name the function"
        f" or class as {key}._target_=my_pkg.module.name. The short form"
        f" {key}=my_pkg.module.name is the whole node: keys beside it replace it, or it"
        " replaces them"
    )


def _called_as(key: str, fn: Callable, call: str, given: Mapping, passed: tuple[str, ...]) -> str:
    """What stops ``fn`` from being called as ``call`` (``step(model, batch)``: its arguments
    by position) with the ``given`` keys and the ``passed`` names it takes by keyword, in
    words; empty where nothing does (or no signature can be read)."""
    sig = _signature(fn)
    if sig is None:
        return ""
    names = call.rstrip(")").split("(")[1].split(", ")
    by_name = dict(given) | {n: None for n in passed if accepts(fn, n) and n not in given}
    try:
        sig.bind(*names, **by_name)
    except TypeError as exc:
        why = f"takes {_bare(sig)}, and the loop calls it as {call}: {exc}"
        lacking = re.fullmatch(r"missing a required (?:keyword-only )?argument: '(\w+)'", str(exc))
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL)
        name = lacking[1] if lacking else ""
        if name and name not in names and sig.parameters[name].kind not in positional:
            return (
                f"{why}. Give it with +{key}.{name}=<value>, or take the {names[-1]} as one"
                " argument and read its parts inside"
            )
        return f"{why}. Make its first arguments ({', '.join(names)})"
    return ""


def _bare(sig: inspect.Signature) -> str:
    """A signature as written, its annotations left out: ``(model, batch, *, weight=1.0)``."""
    params = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=sig.empty))


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


def check_keys(
    key: str,
    target: str,
    obj: Callable,
    given: Iterable[str],
    fix: Callable[[str], str] | None = None,
) -> None:
    """Every key in ``given`` is an argument of ``obj``; else a ConfigError naming the first
    that is not, what ``obj`` does take, and how to drop it (and ``fix(name)`` after)."""
    sig = _signature(obj)
    if sig is None or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return
    for name in given:
        if name in META or name in sig.parameters:
            continue
        takes = ", ".join(arguments(obj)) or "no keyword arguments"
        raise ConfigError(
            f"{key}.{name} is not an argument of {target}, which takes: {takes}."
            f" Fix the key, or drop it ('~{key}.{name}' on the command line)"
            f"{fix(name) if fix else ''}"
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
