"""psgd's Python API, low level: your own training loop against parameter shards.

For users who keep their loop (ps-lite's Push / Pull, Horovod's wrapped optimizer):
`start_shards(servers, workers, mode, optimizer, steps, **flags)` starts shards in this process
(a `Shards`: `.addresses`, `.params()`, `.stats()`, `.wait()`, `.stop()`, a context manager), or
`psgd server` processes run elsewhere; `connect(model, addresses, rank, workers, ...)` makes
`model` a `Worker` of that job: `pull()` the current parameters into the model, backward, `push()`
the gradient (zeroed for the next step), or `step()` for both; `join=True` takes a slot in a job
that is running already. Same update rules, wire and policies as `psgd run` (psgd/ps/exchange.py
under the hood); by default a push and the next pull are one round trip (PushPull). Bad
arguments raise ValueError; a shard that fails, refuses or times out, ExchangeError. Nothing here
is thread-safe: one Worker per thread. Shards started and stopped, workers joined and gone are
logged at DEBUG (`psgd.api.loop`'s logger). Re-exported by psgd/api/__init__.py.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from psgd.api.jobs import config
from psgd.core import config as C
from psgd.core.errors import ExchangeError, UsageError

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger(__name__)


# -- low level: shards ----------------------------------------------------------------------------
class Shards:
    """K shard servers in this process, each on 127.0.0.1 (or `host`) port 0; stop() them, or use
    `with`. `addresses` is what `connect` (or `psgd worker --servers`) takes."""

    def __init__(self, servers: list, host: str) -> None:
        self._servers = servers
        self.addresses = [f"{host}:{s.port}" for s in servers]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every worker has left (or `timeout` seconds); True if they all have."""
        return all(s.shard.finished.wait(timeout) for s in self._servers)

    def params(self) -> torch.Tensor:
        """The shards' parameters now, joined into one flat vector (a copy)."""
        import torch  # noqa: PLC0415

        parts = []
        for s in self._servers:
            with s.shard.lock:
                if s.shard.param is None:
                    raise RuntimeError("the shards are not initialised yet (no worker has connected)")
                parts.append(s.shard.param.detach().clone())
        return torch.cat(parts)

    def stats(self) -> list[dict]:
        """Each shard's stats (version, staleness histogram, bytes; what shard-K.json holds)."""
        return [s.shard.stats() for s in self._servers]

    def stop(self) -> None:
        """Stop every shard (idempotent); a worker still connected gets an error on its next call."""
        for s in self._servers:
            s.stop(grace=0)
        if self._servers:
            log.debug("stopped the shards at %s", ",".join(self.addresses))
        self._servers = []

    def __enter__(self) -> Shards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_shards(servers: int = 1, workers: int = 1, mode: str = "sync", optimizer: Any = None,
                 steps: int | None = None, host: str = "127.0.0.1", **flags: Any) -> Shards:
    """Start `servers` shards of a `mode` run with `workers` workers, in this process; returns at once.

    The shards size themselves from the first worker's Init (its model). `steps`: the budget, in
    updates for sync and gradients per worker otherwise, as `psgd run --steps`; None: no budget,
    the run ends when every worker has left. Other keywords: the shard's `psgd run` flags
    (`staleness=`, `backup_workers=`, `wire_dtype=` ...). Raises ValueError for a bad one.
    """
    from psgd.train import assemble  # noqa: PLC0415

    if mode == "allreduce":
        raise ValueError("mode='allreduce' has no shards: use psgd.fit(mode='allreduce')")
    worker_side = sorted(k for k in flags if k in ("local_steps", "accumulate", "overlap", "topk", "batch_size"))
    if worker_side:
        raise ValueError(f"{worker_side[0]}= is a worker's setting, not a shard's: your loop decides it (connect "
                         "pushes one gradient per step)")
    budget = steps if steps is not None else (1 << 62) // max(1, workers)  # no budget: the workers decide
    cfg = config(servers=servers, workers=workers, mode=mode, optimizer=optimizer, steps=budget,
                 eval_every=flags.pop("eval_every", 0), **flags)
    started: list = []
    try:
        for k in range(servers):
            started.append(assemble.shard_server(cfg, k, host, 0))
    except BaseException:
        for s in started:
            s.stop(grace=0)
        raise
    shards = Shards(started, host)
    log.debug("%d %s shards for %d workers listening at %s", servers, mode, workers, ",".join(shards.addresses))
    return shards


# -- low level: a worker --------------------------------------------------------------------------
class Worker:
    """One worker of a parameter-server job, driven by your loop (see the module docstring).

    Build it with `connect`. The model's parameters and gradients become views of two flat
    buffers (psgd/train/models.py `FlatParams`): the pulled parameters land in the model with one
    copy, and backward writes the gradient straight where `push` sends it from.
    """

    def __init__(self, model: nn.Module, exchange: Any, rank: int) -> None:
        from psgd.train import models  # noqa: PLC0415

        models.check_trainable(model, "psgd.connect")
        self.model, self.rank = model, rank
        self.flat = models.FlatParams(model)
        self._views = [p.grad for p in model.parameters()]  # where backward must write
        self._exchange = exchange
        self.clock = 0           # steps pushed so far
        self.done = False        # the shards said the budget is spent: push and pull do nothing more
        self._pulled = False     # this step's parameters are in the model
        self.last = None         # the last pull's or push's StepReport (times, bytes, clock gap)
        self._closed = False
        self._broken = False     # a call failed: close() cuts the connections instead of leaving
        exchange.setup(self.flat, rank)
        self.clock = getattr(exchange, "start_clock", 0)
        log.debug("worker %d connected, %d parameters, first clock %d", rank, self.flat.params.numel(), self.clock)

    def pull(self) -> bool:
        """The parameters of this step into the model; False once the run is done.

        Blocks while the consistency policy holds the pull: sync until the step's update is
        applied, SSP while this worker is more than s clocks ahead, the first pull until every
        worker has connected. After a `push` (PushPull) the parameters came with its reply, and
        this returns at once. Raises ExchangeError (a shard failed, refused, or timed out)."""
        if self.done or self._pulled:
            return not self.done
        self.last = self._call(self._exchange.before_compute)
        self._pulled, self.done = True, self.last.done
        return not self.done

    def push(self) -> bool:
        """Send this step's gradient (what backward accumulated in the model's .grad) to the
        shards, then zero it for the next step; False once the run is done (the gradient was
        not taken, or was the last one). Blocks for one round trip (and, with PushPull, for the
        next parameters, which it loads into the model). Raises ExchangeError.

        A `zero_grad(set_to_none=True)` (torch's default) or anything else that replaced a .grad
        is undone first: the gradient is copied back into psgd's buffer and the view restored."""
        if self.done:
            return False
        if not self._pulled:
            self.pull()  # a step computes on pulled parameters; the shards check the clock
            if self.done:
                return False
        self._reattach()
        self.flat.zeroed = False  # backward ran
        self.last = self._call(self._exchange.after_compute)
        self.flat.zero_grad_once()  # a no-op when the exchange zeroed it already, while the shards answered
        self.clock += 1
        self._pulled = self._exchange.combined and not self.last.done  # PushPull brought the next parameters
        self.done = self.last.done
        return not self.done

    def _call(self, fn):
        try:
            return fn(self.clock, self.flat)
        except ExchangeError:
            self._broken = True  # the connections are in no state to Leave: close cuts them
            raise

    def step(self) -> bool:
        """`push()` then `pull()`: one round trip by default. False once the run is done."""
        return self.push() and self.pull()

    def _reattach(self) -> None:
        for p, view in zip(self.model.parameters(), self._views, strict=True):
            if p.grad is view:
                continue
            if p.grad is None:
                view.zero_()       # set_to_none: no gradient since; psgd's buffer is zeroed already
            else:
                view.copy_(p.grad)  # backward wrote into a fresh tensor: take its values
            p.grad = view

    def close(self, failed: bool = False) -> None:
        """Leave the job (the shards stop waiting for this worker) and close the connections.
        Idempotent. `failed`: no Leave, connections cut at once (after a shard failure)."""
        if not self._closed:
            self._closed = True
            self._exchange.close(failed=failed or self._broken)
            log.debug("worker %d %s after %d steps", self.rank, "cut its connections" if failed or self._broken
                      else "left the job", self.clock)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        # Your loop's own error still Leaves, so the other workers go on; a shard's does not wait.
        self.close(failed=isinstance(exc, ExchangeError))


def connect(model: nn.Module, addresses: str | Iterable[str], rank: int = 0, workers: int = 1, *,
            transport: str = "auto", wire_dtype: str = "fp32", separate_pull: bool = False,
            rpc_timeout: float = 60.0, token_file: str = "", tls_ca: str = "", backup_workers: int = 0,
            join: bool = False) -> Worker:
    """Connect `model` as worker `rank` of `workers` to running shards (in shard order); blocks
    until they answer. Every worker offers its parameters as the shards' start and the first Init
    wins: build the models alike (seeded) or the first to connect decides for all.

    `addresses`: "host:port,host:port" or a list, from `start_shards` or `psgd server`'s READY
    lines. `transport` "auto" (the default, as `psgd run`: shared memory on this host, else
    tcp) or one by name (psgd/ps/transport.py). `backup_workers`: the shards'
    (sync): then a worker goes on until every shard said done, as one shard may finish first.
    `join`: join a job that is running already (shards started with spare slots: `max_workers=`
    of `start_shards`, `psgd server --max-workers`); the shards give it a slot (the Worker's
    `rank`; `rank` and `workers` are not used) and its first step (sync: two steps on).
    Raises ValueError for a bad
    argument, ExchangeError when the shards cannot be reached or disagree."""
    from psgd.ps import auth  # noqa: PLC0415
    from psgd.ps.exchange import PSExchange  # noqa: PLC0415

    found = C.parse_servers(addresses) if isinstance(addresses, str) else list(addresses)
    if isinstance(found, int) or not found:
        raise ValueError(f"connect: addresses must be HOST:PORT,..., got {addresses!r}")
    if not join and not 0 <= rank < workers:
        raise ValueError(f"connect: rank must be in 0..{workers - 1}, got {rank}")
    from psgd.ps.transport import check  # noqa: PLC0415

    why = check(transport, tls=bool(tls_ca))
    if why or wire_dtype not in C.WIRE_DTYPES:
        raise ValueError(f"connect: {why or f'wire_dtype must be one of {C.WIRE_DTYPES}'}")
    if not (rpc_timeout > 0 and math.isfinite(rpc_timeout)):
        raise ValueError(f"connect: rpc_timeout must be > 0, got {rpc_timeout}")
    try:
        token = auth.load(token_file)
    except auth.TokenError as e:
        raise ValueError(str(e)) from None
    if join:
        rank = _join(model, list(found), rpc_timeout, token, tls_ca)
    exchange = PSExchange(list(found), wire_dtype, rpc_timeout, transport=transport, separate_pull=separate_pull,
                          token=token, tls_ca=tls_ca, backup_workers=backup_workers)
    try:
        return Worker(model, exchange, rank)
    except UsageError as e:
        exchange.close(failed=True)
        raise ValueError(str(e)) from None
    except BaseException:
        exchange.close(failed=True)
        raise


def _join(model: nn.Module, addresses: list[str], rpc_timeout: float, token, tls_ca: str) -> int:
    """connect(join=True): a slot in the running job (psgd/ps/client.py `join_job`); its id."""
    import torch  # noqa: PLC0415

    from psgd.ps.client import join_job  # noqa: PLC0415
    from psgd.ps.transport import make_transport  # noqa: PLC0415

    transport = make_transport("grpc", addresses, rpc_timeout, None, token, tls_ca)
    try:
        # The parameters in FlatParams' order (psgd/train/models.py): the Init it offers, and the size.
        flat = torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in model.parameters()])
        return join_job(transport, flat)[0]
    finally:
        transport.close()
