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
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psgd.core import config as C
from psgd.core.errors import ExchangeError, UsageError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["AdamW", "FitResult", "SGD", "Shards", "Worker", "connect", "fit", "start_shards"]


# -- optimizers as objects -----------------------------------------------------------------------
def SGD(lr: float = 0.05, momentum: float = 0.9, weight_decay: float = 0.0, warmup: int = 0) -> C.OptimConfig:  # noqa: N802
    """torch.optim.SGD's update (L2 weight decay, heavy-ball momentum), with a linear warmup of
    `warmup` updates; what the shards (or every all-reduce replica) step. Returns its settings."""
    return C.OptimConfig(optimizer="sgd", lr=lr, momentum=momentum, weight_decay=weight_decay, warmup=warmup)


def AdamW(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,  # noqa: N802
          weight_decay: float = 0.01, warmup: int = 0) -> C.OptimConfig:
    """torch.optim.AdamW's update (decoupled weight decay; torch's defaults), with a linear warmup."""
    return C.OptimConfig(optimizer="adamw", lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                         weight_decay=weight_decay, warmup=warmup)


# -- keywords -> RunConfig ------------------------------------------------------------------------
def config(**flags: Any) -> C.RunConfig:
    """A validated RunConfig from `psgd run` flags as keywords (`optimizer` may be psgd.SGD(...) /
    psgd.AdamW(...), `model` / `data` / `loss` callables); ValueError with the flag's message."""
    from psgd.train.userspec import spec_of  # noqa: PLC0415

    leaves = {leaf.name: leaf for leaf in C.leaves()}
    flat: dict[str, Any] = {}
    opt = flags.pop("optimizer", None)
    if isinstance(opt, C.OptimConfig):
        flat.update(dataclasses.asdict(opt))
    elif opt is not None:
        flat["optimizer"] = opt
    for key, name in (("model", "model"), ("data", "dataset"), ("dataset", "dataset"), ("loss", "loss")):
        if key in flags:
            flat[name] = spec_of(flags.pop(key), key)
    for key, value in flags.items():
        leaf = leaves.get(key)
        if leaf is None:
            raise ValueError(f"{key}= is not a psgd run flag (see `psgd run -h`; use _ for -)")
        if isinstance(opt, C.OptimConfig) and leaf.section == "optim":
            raise ValueError(f"{key}= and optimizer= both set the optimizer: give {key} to psgd.{_name(opt)}(...)")
        flat[key] = _coerce(leaf, value)
    return C.validate(C.from_flat(flat))


def _name(opt: C.OptimConfig) -> str:
    return {"sgd": "SGD", "adamw": "AdamW"}.get(opt.optimizer, opt.optimizer)


def _coerce(leaf: C.Leaf, value: Any) -> Any:
    """A keyword's value as the flag's type, or ValueError naming the flag."""
    flag = "--" + leaf.name.replace("_", "-")
    if leaf.name == "servers" and isinstance(value, (list, tuple)):
        return len(value)
    if leaf.type is bool and isinstance(value, bool):
        return value
    if leaf.type is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if leaf.type is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if leaf.type is str and isinstance(value, str):
        return value
    if leaf.type == C.Pairs:
        pairs = value.items() if isinstance(value, dict) else value
        try:
            return tuple((int(a), int(b)) for a, b in pairs)
        except (TypeError, ValueError):
            pass
        raise ValueError(f"{flag} takes {{RANK: N}} or [(RANK, N), ...], got {value!r}")
    kinds = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}
    raise ValueError(f"{flag} takes {kinds.get(leaf.type, leaf.type)}, got {value!r}")


# -- high level -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class FitResult:
    """What `fit` returns: the run's folder, its summary.json, and the trained model."""
    out: Path
    summary: dict
    model: nn.Module       # the model built as the workers built it, holding the final parameters
    config: C.RunConfig


def fit(model: Any = "mlp", data: Any = "synthetic", loss: Any = "cross_entropy", *, mode: str = "sync",
        workers: int = 2, servers: int = 1, steps: int = 100, epochs: float = 0.0, optimizer: Any = None,
        out: str = "", progress: bool = False, tensorboard: str | Path = "", **flags: Any) -> FitResult:
    """Train as `psgd run` does, with real processes; blocks until the run has ended.

    Raises ValueError (a bad keyword, value or spec: one line, before any process starts) or
    psgd.train.launch.RunFailed (a process of the job failed; the message names it). `tensorboard=DIR`:
    the run's curves in DIR/<run folder name> as it trains (psgd/train/tboard.py). Not thread-safe
    with another `fit` writing the same `out`; two fits with their own folders may run at once.
    """
    from psgd.train import data as data_mod  # noqa: PLC0415 - psgd imports nothing heavy on its own
    from psgd.train import launch, models, workload  # noqa: PLC0415
    from psgd.train import progress as live  # noqa: PLC0415

    cfg = config(model=model, data=data, loss=loss, mode=mode, workers=workers, servers=servers, steps=steps,
                 epochs=epochs, optimizer=optimizer, out=out, **flags)
    _check_device(cfg)
    workload.check(cfg)
    if tensorboard:
        from psgd.train import tboard  # noqa: PLC0415

        try:
            tboard.require()
        except UsageError as e:
            raise ValueError(str(e)) from None
    if cfg.epochs > 0:
        cfg = C.with_epochs_resolved(cfg, data_mod.train_size(cfg.data))
    cfg = launch.with_out_resolved(cfg)
    launch.prepare_out(Path(cfg.out))
    with live.live(Path(cfg.out), cfg.budget, f"psgd.fit {cfg.mode}", enabled=progress):
        tb = tboard.run_dir(Path(tensorboard), Path(cfg.out)) if tensorboard else None
        summary = launch.run(cfg, tensorboard=tb)
    import torch  # noqa: PLC0415

    ds = data_mod.load(cfg.data)
    trained = models.build(cfg.model, ds.input_dim, ds.num_classes, cfg.seed)
    final = torch.load(Path(cfg.out) / "final_params.pt", weights_only=True)
    torch.nn.utils.vector_to_parameters(final, trained.parameters())
    return FitResult(Path(cfg.out), summary, trained, cfg)


def _check_device(cfg: C.RunConfig) -> None:
    from psgd.core.devices import DeviceError, parse_device, pick_device  # noqa: PLC0415

    if parse_device(cfg.device)[0] == "cuda":
        import torch  # noqa: PLC0415

        try:
            pick_device(cfg.device, 0, None, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        except DeviceError as e:
            raise ValueError(str(e)) from None


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
    return Shards(started, host)


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

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        # Your loop's own error still Leaves, so the other workers go on; a shard's does not wait.
        self.close(failed=isinstance(exc, ExchangeError))


def connect(model: nn.Module, addresses: str | Iterable[str], rank: int = 0, workers: int = 1, *,
            transport: str = "tcp", wire_dtype: str = "fp32", separate_pull: bool = False,
            rpc_timeout: float = 60.0, token_file: str = "", tls_ca: str = "", backup_workers: int = 0,
            join: bool = False) -> Worker:
    """Connect `model` as worker `rank` of `workers` to running shards (in shard order); blocks
    until they answer. Every worker offers its parameters as the shards' start and the first Init
    wins: build the models alike (seeded) or the first to connect decides for all.

    `addresses`: "host:port,host:port" or a list, from `start_shards` or `psgd server`'s READY
    lines. `transport` "tcp" (the default, as `psgd run`) or "grpc". `backup_workers`: the shards'
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
    if transport not in C.TRANSPORTS or wire_dtype not in C.WIRE_DTYPES:
        raise ValueError(f"connect: transport must be one of {C.TRANSPORTS} and wire_dtype one of {C.WIRE_DTYPES}")
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


def summary_of(out: str | Path) -> dict:
    """summary.json of a finished run folder."""
    return json.loads((Path(out) / "summary.json").read_text())
