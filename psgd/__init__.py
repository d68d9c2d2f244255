"""psgd: a parameter-server and all-reduce lab for data-parallel SGD, and a library for your own model.

The public API (the package psgd/api/; each name is imported on first use, so `import psgd` and the
`psgd` command stay free of torch until they need it):

    psgd.fit(model=..., data=..., loss=..., mode="sync", workers=4, servers=2, steps=..., optimizer=...)
        the same job as `psgd run`, with real processes; returns a FitResult (summary, trained model)
    psgd.start_shards(servers=2, workers=2, mode="sync", optimizer=psgd.SGD(lr=0.1))
        shard servers in this process; `.addresses`, `.params()`, `.stop()`
    psgd.connect(model, addresses, rank=0, workers=2)
        a Worker for your own loop: pull() / push() / step(), a context manager that leaves cleanly
    psgd.SGD(...), psgd.AdamW(...)
        the optimizers the shards (or all-reduce replicas) step, as objects

See README.md ("Train your own model"), docs/tutorial.md and examples/08-10 for them in use, and
docs/architecture.md for how the pieces fit together.

`psgd.__version__` (and `psgd --version`) is the installed distribution's version, read from its
metadata; a source tree that was never installed says pyproject.toml's, kept here as the fallback.
psgd's progress and diagnostics go through the standard `logging` module, under the logger named
"psgd" (each module's own below it, e.g. "psgd.train.launch"): the library adds no handler to
it, so a program that calls `logging.basicConfig(level=logging.DEBUG)` sees what `psgd.fit` does,
and one that configures nothing sees only the warnings, on stderr, as Python shows any library's.
The `psgd` command prints those warnings as its own lines (psgd/cli.py).
"""

from __future__ import annotations

from typing import Any

_SOURCE_VERSION = "0.1.0"  # pyproject.toml's [project] version (tests/test_packaging.py checks they agree)
__all__ = ["AdamW", "FitResult", "SGD", "Shards", "Worker", "connect", "fit", "start_shards"]


def version() -> str:
    """The version of the psgd distribution installed (its metadata), else the source tree's."""
    from importlib.metadata import PackageNotFoundError  # noqa: PLC0415 - only who asks pays for it
    from importlib.metadata import version as installed  # noqa: PLC0415

    try:
        return installed("psgd")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, never pip-installed
        return _SOURCE_VERSION


def __getattr__(name: str) -> Any:
    if name == "__version__":
        return version()
    if name in __all__:
        from psgd import api

        return getattr(api, name)
    raise AttributeError(f"module 'psgd' has no attribute {name!r}")
