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
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["AdamW", "FitResult", "SGD", "Shards", "Worker", "connect", "fit", "start_shards"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from psgd import api

        return getattr(api, name)
    raise AttributeError(f"module 'psgd' has no attribute {name!r}")
