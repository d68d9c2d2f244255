"""psgd's Python API, at two levels: whole jobs (`fit`), and your own loop (`start_shards`, `connect`).

High level, the same job as `psgd run` (real processes: K shard servers and N workers, or N
all-reduce ranks), on your own model, data and loss:

    result = psgd.fit(model="my_pkg.nets:make_model", data="my_pkg.data:make_data",
                      mode="sync", workers=4, servers=2, steps=500, optimizer=psgd.AdamW(lr=1e-3))
    result.summary["final_test_loss"], result.model   # summary.json's figures, the trained nn.Module

`model`, `data` and `loss` are built-in names (`"mlp"`, `"mnist1d"`, `"cross_entropy"`), import
paths (`"pkg.mod:fn"`, `"path/file.py:fn"`) or the callables themselves, which must be importable
by name, since every process of the job builds its own (psgd/train/userspec.py). Every other
keyword is a `psgd run` flag with `_` for `-` (`batch_size=32`, `wire_dtype="fp16"`); a keyword
that is not one, or a bad value, raises ValueError with the flag's own message.

Low level, for users who keep their training loop (ps-lite's Push / Pull, Horovod's wrapped
optimizer): shards in this process (or `psgd server` processes elsewhere), and a worker handle:

    with psgd.start_shards(workers=2, mode="sync", optimizer=psgd.SGD(lr=0.1)) as shards, \\
         psgd.connect(model, shards.addresses, rank=0, workers=2) as w:
        for x, y in my_batches:
            w.pull()                              # the current parameters, into `model`
            loss_fn(model(x), y).backward()       # gradients accumulate into psgd's flat buffer
            w.push()                              # the gradient to the shards; zeroed for the next step

Same update rules, wire and policies as `psgd run` (psgd/ps/exchange.py under the hood). By
default a push and the next pull are one round trip (PushPull): `push()` brings back the next
parameters and the `pull()` after it returns at once. Nothing here is thread-safe: one worker
handle per thread, as one worker per process in `psgd run`.

The package: psgd/api/jobs.py (the optimizers as objects, keywords -> RunConfig, `fit`) and
psgd/api/loop.py (`start_shards` / `Shards`, `connect` / `Worker`); every name is re-exported
here, and psgd/__init__.py re-exports the public ones lazily (`import psgd` imports no torch).
"""

from __future__ import annotations

from psgd.api.jobs import SGD, AdamW, FitResult, fit
from psgd.api.jobs import config as config
from psgd.api.jobs import summary_of as summary_of
from psgd.api.loop import Shards, Worker, connect, start_shards

__all__ = ["AdamW", "FitResult", "SGD", "Shards", "Worker", "connect", "fit", "start_shards"]
