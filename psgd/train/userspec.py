"""Your model, data and loss by import path: `--model pkg.mod:make_model`, `--dataset data.py:make_data`.

Contract:
- A spec is `MODULE:ATTR` (imported as Python would from the current directory, as `python -m`
  does) or `PATH.py:ATTR` (that file, loaded as a module of its own; a relative path is taken
  from the current directory). ATTR may be dotted (`Nets.small`). `resolve(spec, flag)` returns
  the callable; `SpecError` (a ValueError whose message is one line naming the flag) when the
  module does not import (the ImportError's own message), the attribute is missing, it is not
  callable, or it needs arguments (every parameter must have a default).
- `source_hash(spec)`: sha256 of the file the spec resolves to (the file itself, or the module's
  `__file__`). config.json records it beside the spec, and the suite's run cache keys on it, so an
  edited model file is never mistaken for the one a cached run trained.
- The callables run in every process of a job (each worker builds the same seeded model), so
  they must be importable by name: a lambda, a closure or a function of `__main__` cannot be
  (`spec_of(obj)` says so in one line, and gives the spec of anything that is).

What the callables must return is checked where they are used (psgd/train/workload.py). Pure
mechanics here: importlib, inspect, hashlib; no torch.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


class SpecError(ValueError):
    """A spec that cannot be used; the message is one line and names the flag."""


def split(spec: str) -> tuple[str, str]:
    """`left:attr` -> (left, attr); the last colon splits, so a Windows-style path keeps its own."""
    left, sep, attr = spec.rpartition(":")
    if not sep or not left or not attr:
        raise SpecError(f"expected MODULE:FUNCTION or FILE.py:FUNCTION, got {spec!r}")
    return left, attr


def is_file_spec(left: str) -> bool:
    return left.endswith(".py") or os.sep in left or "/" in left


def _module(left: str, flag: str) -> ModuleType:
    if is_file_spec(left):
        path = Path(left).expanduser().resolve()
        if not path.is_file():
            raise SpecError(f"{flag} {left}: no such file")
        # One module per file content: a name of its own, so two files called model.py do not collide,
        # and registered in sys.modules (dataclasses and pickle look classes up there).
        name = "psgd_user_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, f"{path} is a .py file"
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException as e:
            del sys.modules[name]
            raise SpecError(f"{flag} {left}: importing it failed: {type(e).__name__}: {_one_line(e)}") from None
        return module
    with_cwd_on_path()
    try:
        return importlib.import_module(left)
    except ImportError as e:
        raise SpecError(f"{flag} {left}: {_one_line(e)}") from None
    except BaseException as e:  # the module's own code failed while importing
        raise SpecError(f"{flag} {left}: importing it failed: {type(e).__name__}: {_one_line(e)}") from None


def with_cwd_on_path() -> None:
    """`python -m` puts the current directory first on sys.path; the `psgd` script does not. Put it
    there either way, and leave it (a builder may import its siblings later, when it is called), so
    that the launcher's check, its hashes and the children agree on what a name means."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def resolve(spec: str, flag: str, args: tuple[str, ...] = ()) -> Callable:
    """The callable `spec` names, checked to be callable with exactly the positional `args` (their
    names, for the message; none for a model or data builder: see the module docstring)."""
    left, attr = split(spec)
    obj: object = _module(left, flag)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SpecError(f"{flag} {spec}: {left} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise SpecError(f"{flag} {spec}: {attr} is a {type(obj).__name__}, not a callable")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return obj  # a builtin without a signature: called as is
    try:
        sig.bind(*args)
    except TypeError:
        required = [p.name for p in sig.parameters.values() if p.default is p.empty
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        called = f"({', '.join(args)})" if args else "with no arguments"
        raise SpecError(f"{flag} {spec}: psgd calls {attr} {called}, but it takes ({', '.join(required)}); "
                        + ("give the others defaults" if args else "give them defaults or wrap it in a function "
                           "that has none")) from None
    return obj


def source_file(spec: str) -> Path | None:
    """The file `spec` resolves to (for its hash), or None for a module without one."""
    left, _ = split(spec)
    if is_file_spec(left):
        return Path(left).expanduser().resolve()
    module = sys.modules.get(left)
    file = getattr(module, "__file__", None)
    return Path(file) if file else None


def source_hash(spec: str) -> str:
    """sha256 of the spec's source file (`resolve` it first for a module spec), or "" without one."""
    path = source_file(spec)
    return hashlib.sha256(path.read_bytes()).hexdigest() if path is not None and path.is_file() else ""


def spec_of(obj: object, what: str) -> str:
    """The spec that names `obj` in another process (`psgd.fit(model=MyNet)`); SpecError if none can.

    A string is taken as a spec already. `what` names the argument in the message."""
    if isinstance(obj, str):
        return obj
    name = getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    if not callable(obj) or not name or not module:
        raise SpecError(f"{what}= takes a callable or a spec string, got {type(obj).__name__}")
    if "<lambda>" in name or "<locals>" in name:
        raise SpecError(f"{what}={name}: a lambda or a nested function cannot be imported by the job's other "
                        "processes; define it at the top level of a module or file")
    if module == "__main__":
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        hint = f'{what}="{main_file}:{name}"' if main_file else f'{what}="FILE.py:{name}"'
        raise SpecError(f"{what}={name} is defined in __main__, which the job's other processes cannot import; "
                        f"pass {hint} (keep the script's own work under `if __name__ == \"__main__\":`)")
    if module.startswith("psgd_user_"):  # loaded from a file by `resolve`: name the file again
        return f"{sys.modules[module].__file__}:{name}"
    return f"{module}:{name}"


def _one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return " ".join(text.split())
