"""The pre-flight of `psgd run` and `psgd.fit`: everything that can refuse a run before any process
starts, then its folder, prepared once.

`prepare(cfg, tensorboard=, resume=, live_eval=)` refuses with one line (a UsageError, exit 2 from the CLI, a
ValueError from psgd.fit) a CUDA --device this host lacks, --dataset mnist without its files, your
own model / data / loss that fails on one batch (psgd/train/workload.py), --cpu-quota where CPU
groups are not available, --tensorboard without its package (--live-eval without it, or on a run
whose checkpoints it cannot evaluate: psgd/train/liveeval.py), --hosts without the cluster up and
large enough, a --token-file it cannot read, more processes or memory than this host has
(psgd/train/limits.py), an --out it cannot write; then resolves --epochs into steps and, for a
fresh run, makes the run folder
(psgd/train/rundir.py `fresh`: the only preparation of a fresh run's folder; `launch.run(...,
prepared=True)` takes it as it is). It returns the config the run goes on with. Imports no torch
unless a check needs it (a CUDA device, a dataset's size for --epochs, your own model).
"""

from __future__ import annotations

from psgd.core import config as C
from psgd.core.errors import UsageError
from psgd.train import hosts, limits, rundir
from psgd.train.roles import check_data, token, worker_device_of

SMALL_MODELS = ("logreg", "mlp")  # at their default width, too small to count (no torch for them)


def prepare(cfg: C.RunConfig, tensorboard: bool = False, resume: bool = False, live_eval: bool = False) -> C.RunConfig:
    """The checks, the epochs and the folder (see the module docstring)."""
    if live_eval:
        from psgd.train import liveeval  # noqa: PLC0415

        why = "--live-eval draws on TensorBoard: give --tensorboard DIR too" if not tensorboard else liveeval.unfit(cfg)
        if why:
            raise UsageError(why)
    check_device(cfg)
    check_data(cfg)  # --dataset mnist's files, where --data-dir says
    check_workload(cfg)
    if cfg.cpu_quota > 0:
        from psgd.train import cpulimit  # noqa: PLC0415

        reason = cpulimit.unavailable()
        if reason:
            raise UsageError(reason)
    if tensorboard:
        from psgd.train import tboard  # noqa: PLC0415

        tboard.require()
    hosts.seats(cfg)  # --hosts: the cluster is up and large enough, before a run folder is made
    token(cfg)  # --token-file: readable and a token, here rather than as the first shard's failure
    limits.check(cfg, count_params(cfg))  # --hosts' namespaces share this host's pids and memory
    if cfg.epochs > 0:
        from psgd.train import data  # noqa: PLC0415 - torch: only --epochs needs the dataset's size

        cfg = C.with_epochs_resolved(cfg, data.train_size(cfg.data))
    if resume:
        return cfg
    try:
        return rundir.fresh(cfg)
    except OSError as e:  # read-only, under a file, no room: one line, not a traceback
        where = cfg.out or rundir.RUNS
        raise UsageError(f"--out {where}: cannot make the run folder there ({e.strerror or e})") from None


def count_params(cfg: C.RunConfig) -> int | None:
    """The model's parameter count (torch's meta device: nothing allocated), or None for a small
    built-in model at its default width and for your own data (its shape is known once loaded)."""
    if (cfg.model.model in SMALL_MODELS and not cfg.model.width) or C.is_spec(cfg.data.dataset):
        return None
    from psgd.train import data, models  # noqa: PLC0415 - torch

    shape = data.SHAPES.get(cfg.data.dataset)
    return None if shape is None else models.count(cfg.model, *shape)


def check_device(cfg: C.RunConfig) -> None:
    """Refuse a CUDA --device this host does not have (no CUDA device, or cuda:N beyond its count):
    at once, before any process starts, rather than as each worker's failure. Here and not in
    psgd/core, which imports no torch; the servers skip it (they keep their shard on the CPU
    whatever --device says). Every worker checks its own host again (psgd/core/devices.py)."""
    from psgd.core.devices import parse_device  # noqa: PLC0415

    if parse_device(cfg.device)[0] == "cuda":  # importing torch costs about a second: only then
        worker_device_of(cfg, rank=0)


def check_workload(cfg: C.RunConfig) -> None:
    """The user's --model / --dataset / --loss specs work on one batch (psgd/train/workload.py)."""
    if not any(C.is_spec(n) for n in (cfg.model.model, cfg.data.dataset, cfg.model.loss)):
        return  # built-in names: nothing to import here (the launcher stays free of torch)
    from psgd.train import workload  # noqa: PLC0415
    from psgd.train.userspec import SpecError  # noqa: PLC0415

    try:
        workload.check(cfg)
    except SpecError as e:
        raise UsageError(str(e)) from None
