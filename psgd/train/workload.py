"""What a run trains, checked once before any process starts: the model, the data, the loss.

Contract:
- `specs(cfg)`: the settings that name the user's own callables by import path (`--model`,
  `--dataset`, `--loss`; psgd/train/userspec.py), flag -> spec; empty for a run of built-ins.
- `sources(cfg)`: for each of them the spec and the sha256 of the file it resolves to, found
  without running it (`importlib.util.find_spec`). `psgd run` writes it into config.json
  ("sources"), and the suite's run cache keys on it (psgd/lab/experiment.py `run_digest`).
- `check(cfg)`: builds what the workers will build (the seeded model, the data, the loss) and runs
  the model and the loss on one batch of the training set, so that every bad spec is one line
  (SpecError) before a folder is made or a process started: a module that does not import, a
  missing attribute, a callable that needs arguments, a return value that is not an nn.Module or
  not (train, test), tensors of mismatched lengths, a model with a persistent buffer, a
  model whose output does not fit the loss, a loss that is not a finite scalar, `--shard-data
  noniid | dirichlet` without class labels. Built-in names need no check (config.validate did it).
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from psgd.core.config import RunConfig, is_spec
from psgd.train import userspec

SPEC_FLAGS = {"--model": lambda c: c.model.model, "--dataset": lambda c: c.data.dataset,
              "--loss": lambda c: c.model.loss}


def specs(cfg: RunConfig) -> dict[str, str]:
    return {flag: get(cfg) for flag, get in SPEC_FLAGS.items() if is_spec(get(cfg))}


def _file_of(spec: str) -> Path | None:
    left, _ = userspec.split(spec)
    if userspec.is_file_spec(left):
        return Path(left).expanduser().resolve()
    userspec.with_cwd_on_path()  # as the import itself will (userspec._module)
    try:
        found = importlib.util.find_spec(left)
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found is not None and found.origin not in (None, "built-in", "frozen") else None


def sources(cfg: RunConfig) -> dict[str, dict]:
    """flag -> {"spec", "file", "sha256"} of each spec (sha256 "" when its file cannot be read)."""
    out = {}
    for flag, spec in specs(cfg).items():
        path = _file_of(spec)
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path is not None and path.is_file() else ""
        out[flag] = {"spec": spec, "file": str(path) if path else "", "sha256": digest}
    return out


def check(cfg: RunConfig) -> None:
    """Raise SpecError (one line) unless the run's own model, data and loss work on one batch."""
    if not specs(cfg):
        return
    import torch  # noqa: PLC0415 - only a run with the user's own callables pays for it here

    from psgd.train import data as data_mod  # noqa: PLC0415
    from psgd.train import losses, models  # noqa: PLC0415

    loss_fn = losses.get(cfg.model.loss)
    ds = data_mod.load(cfg.data)
    labels = data_mod.is_labels(ds.y_train)
    if cfg.data.shard_data != "iid" and (not labels or ds.y_train.dim() != 1):
        raise userspec.SpecError(f"--shard-data {cfg.data.shard_data} splits the data by class label: --dataset "
                                 f"{cfg.data.dataset} has no integer label per sample")
    if cfg.model.loss == "cross_entropy" and not labels:
        raise userspec.SpecError(f"--loss cross_entropy needs integer class targets; --dataset {cfg.data.dataset} "
                                 f"has {ds.y_train.dtype} targets: give --loss mse or your own")
    model = models.build(cfg.model, ds.input_dim, ds.num_classes, cfg.seed)
    x, y = ds.x_train[:2], ds.y_train[:2]
    where = f"the model ({cfg.model.model}) and --loss {cfg.model.loss} on a batch of the training set"
    try:
        out = model(x)
        loss = loss_fn(out, y)
    except Exception as e:  # noqa: BLE001 - the user's code: its error, in one line, is the message
        raise userspec.SpecError(f"{where} failed: {type(e).__name__}: {' '.join(str(e).split())}") from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.dtype.is_floating_point:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise userspec.SpecError(f"{where}: the loss must be a floating-point scalar tensor, got {got}")
    if not loss.requires_grad:
        raise userspec.SpecError(f"{where}: the loss does not depend on the model's parameters (no gradient)")
    if not torch.isfinite(loss.detach()).all():
        raise userspec.SpecError(f"{where}: the loss is {float(loss)} at initialisation")
