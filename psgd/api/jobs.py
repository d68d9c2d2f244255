"""psgd's Python API, high level: whole jobs (`fit`), and the optimizers as objects.

`fit(model, data, loss, mode=..., workers=..., servers=..., steps=..., optimizer=...)` runs the
same job as `psgd run` (real processes: K shard servers and N workers, or N all-reduce ranks) on
your own model, data and loss, blocks until it has ended, and returns a `FitResult` (the run
folder, its summary.json, the trained model). `model`, `data` and `loss` are built-in names,
import paths (`"pkg.mod:fn"`, `"path/file.py:fn"`) or importable callables (psgd/train/userspec.py).
Every other keyword is a `psgd run` flag with `_` for `-`; `config(**flags)` turns them into a
validated RunConfig, and a keyword that is not one, or a bad value, raises ValueError with the
flag's own message. `SGD(...)` / `AdamW(...)`: the optimizer settings the shards (or every
all-reduce replica) step. Re-exported by psgd/api/__init__.py (`psgd.api`, and lazily `psgd`).
`fit` says what it does through `logging` (the `psgd.api.jobs` logger, the launcher's below
`psgd.train`): the job and its folder at INFO, each phase at DEBUG, a training loss that rose at
the end as a warning (what `psgd run` prints after its summary line).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psgd.core import config as C
from psgd.core.errors import UsageError

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)


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
    cfg = C.validate(C.from_flat(flat))
    if cfg.transport != "auto":  # the transports name themselves: their registry when one is named
        from psgd.ps import transport  # noqa: PLC0415

        why = transport.check(cfg.transport, cfg.hosts, bool(cfg.tls_ca))
        if why:
            raise ValueError(why)
    return cfg


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


def _simulated(cfg: C.RunConfig, sim: dict, check_only: bool = False) -> dict | None:
    """`fit(simulate=True)`: psgd/sim/run.py `simulate` (`check_only`: its settings and `check`, no run);
    a bad setting is a ValueError, as fit's others are."""
    from psgd.sim import run as sim_run  # noqa: PLC0415

    try:
        settings = sim_run.SimConfig(**sim)
    except TypeError:
        raise ValueError(f"unknown simulation keyword(s) {', '.join('sim_' + k for k in sim)}; known: sim_compute, "
                         "sim_speeds, sim_apply, sim_profile") from None
    try:
        if check_only:
            sim_run.check(cfg)
            return None
        return sim_run.simulate(cfg, settings, prepared=True)
    except UsageError as e:
        raise ValueError(str(e)) from None


def fit(model: Any = "mlp", data: Any = "synthetic", loss: Any = "cross_entropy", *, mode: str = "sync",
        workers: int = 2, servers: int = 1, steps: int = 100, epochs: float = 0.0, optimizer: Any = None,
        out: str = "", progress: bool = False, tensorboard: str | Path = "", simulate: bool = False,
        live_eval: bool = False, **flags: Any) -> FitResult:
    """Train as `psgd run` does, with real processes; blocks until the run has ended.
    `simulate=True`: as `psgd run --simulate`, a SIMULATED cluster in this process (psgd/sim/), its time
    model from `sim_compute=`, `sim_speeds=`, `sim_apply=`, `sim_profile=` (the flags' values).

    Raises ValueError (a bad keyword, value or spec: one line, before any process starts) or
    psgd.train.launch.RunFailed (a process of the job failed; the message names it). `tensorboard=DIR`:
    the run's curves in DIR/<run folder name> as it trains (psgd/train/tboard.py); `live_eval=True`
    with it (and checkpoint_every=K): the evaluations too, as the checkpoints come. Not thread-safe
    with another `fit` writing the same `out`; two fits with their own folders may run at once.
    """
    from psgd.train import data as data_mod  # noqa: PLC0415 - psgd imports nothing heavy on its own
    from psgd.train import launch, models, preflight, tboard  # noqa: PLC0415
    from psgd.train import progress as live  # noqa: PLC0415

    sim = {k.removeprefix("sim_"): flags.pop(k) for k in [k for k in flags if k.startswith("sim_")]}
    cfg = config(model=model, data=data, loss=loss, mode=mode, workers=workers, servers=servers, steps=steps,
                 epochs=epochs, optimizer=optimizer, out=out, **flags)
    if simulate:
        _simulated(cfg, sim, check_only=True)  # what it does not model: a ValueError before any folder
        if live_eval:
            raise ValueError("live_eval evaluates a real run's checkpoints while it trains: not with simulate")
    # `psgd run`'s pre-flight; its UsageError is a ValueError
    cfg = preflight.prepare(cfg, tensorboard=bool(tensorboard), live_eval=live_eval)
    log.info("psgd.fit: %s, %d workers, model %s, data %s, loss %s -> %s", cfg.mode, cfg.workers, cfg.model.model,
             cfg.data.dataset, cfg.model.loss, cfg.out)
    with live.live(Path(cfg.out), cfg.budget, f"psgd.fit {cfg.mode}", enabled=progress):
        tb = tboard.run_dir(Path(tensorboard), Path(cfg.out)) if tensorboard else None
        summary = (_simulated(cfg, sim) if simulate
                   else launch.run(cfg, tensorboard=tb, prepared=True, live_eval=live_eval))
    if summary.get("loss_rose"):
        from psgd.train.divergence import Rise  # noqa: PLC0415

        log.warning("%s", Rise(**summary["loss_rose"]).message())
    log.debug("psgd.fit: loading the trained model from %s", Path(cfg.out) / "final_params.pt")
    import torch  # noqa: PLC0415

    ds = data_mod.load(cfg.data)
    trained = models.build(cfg.model, ds.input_dim, ds.num_classes, cfg.seed)
    final = torch.load(Path(cfg.out) / "final_params.pt", weights_only=True)
    torch.nn.utils.vector_to_parameters(final, trained.parameters())
    return FitResult(Path(cfg.out), summary, trained, cfg)


def summary_of(out: str | Path) -> dict:
    """summary.json of a finished run folder."""
    return json.loads((Path(out) / "summary.json").read_text())
