"""Datasets and the per-worker split of each global batch.

Contract:
- `load(cfg)` returns a `Dataset` of float32 inputs and int64 labels, train and test:
  `synthetic` (a seeded teacher network labels Gaussian inputs; fast, the test default),
  `mnist1d` (the MNIST-1D benchmark, Greydanus 2020, generated offline by the `mnist1d`
  package's make_dataset and cached as .npz; `--num-samples` may exceed its default 5,000),
  and `mnist` (standard IDX files, optionally gzipped, from `--data-dir`).
- `BatchPlan` fixes the sequence of global batches from (seed, global batch size) alone:
  epoch e is a seeded permutation of the training set, cut into global batches (the last
  partial batch is dropped). Worker r takes slice r of global batch t, so 4 workers x batch 8
  see exactly the samples of 1 worker x batch 32. With `noniid`, the training set is sorted by
  label and cut into N contiguous parts; worker r draws its batches from part r only.
"""

from __future__ import annotations

import gzip
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from psgd.config import DataConfig

TRAIN_FRACTION = 0.8  # split of generated datasets (mnist1d's own default)


@dataclass(frozen=True)
class Dataset:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    @property
    def input_dim(self) -> int:
        return int(self.x_train[0].numel())


def cache_dir(cfg: DataConfig) -> Path:
    return Path(cfg.data_dir) if cfg.data_dir else Path.home() / ".cache" / "psgd"


def load(cfg: DataConfig) -> Dataset:
    if cfg.dataset == "synthetic":
        return _synthetic(cfg.num_samples, cfg.data_seed)
    if cfg.dataset == "mnist1d":
        return _mnist1d(cfg)
    if cfg.dataset == "mnist":
        return _mnist_idx(Path(cfg.data_dir or "."))
    raise ValueError(f"unknown dataset {cfg.dataset!r}")


def train_size(cfg: DataConfig) -> int:
    """Training-set size without loading the data when it can be derived (for --epochs)."""
    if cfg.dataset in ("synthetic", "mnist1d"):
        return int(cfg.num_samples * TRAIN_FRACTION)
    return int(load(cfg).x_train.shape[0])


def _synthetic(n: int, seed: int, dim: int = 32, classes: int = 10) -> Dataset:
    """Gaussian inputs labelled by a random two-layer teacher: an MLP beats logreg on it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w1 = torch.randn(dim, 64, generator=g) / dim ** 0.5
    w2 = torch.randn(64, classes, generator=g) / 8.0
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    cut = int(n * TRAIN_FRACTION)
    return Dataset(x[:cut], y[:cut], x[cut:], y[cut:], classes)


def _mnist1d(cfg: DataConfig) -> Dataset:
    path = cache_dir(cfg) / f"mnist1d-n{cfg.num_samples}-seed{cfg.data_seed}.npz"
    if not path.exists():
        from mnist1d.data import get_dataset_args, make_dataset  # imported lazily: slow-ish

        args = get_dataset_args()
        args.num_samples, args.seed, args.train_split = cfg.num_samples, cfg.data_seed, TRAIN_FRACTION
        d = make_dataset(args)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(tmp, x=d["x"], y=d["y"], x_test=d["x_test"], y_test=d["y_test"])
        os.replace(tmp, path)  # atomic: several processes may generate at once
    with np.load(path) as d:
        return Dataset(torch.from_numpy(d["x"].astype(np.float32)), torch.from_numpy(d["y"].astype(np.int64)),
                       torch.from_numpy(d["x_test"].astype(np.float32)),
                       torch.from_numpy(d["y_test"].astype(np.int64)), 10)


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    shape = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _mnist_idx(root: Path) -> Dataset:
    def find(stem: str) -> Path:
        for name in (stem, stem + ".gz"):
            if (root / name).exists():
                return root / name
        raise FileNotFoundError(f"MNIST file {stem}[.gz] not found in --data-dir {root}")

    parts = [_read_idx(find(s)) for s in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                                          "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")]
    xs = [torch.from_numpy(p.reshape(p.shape[0], -1).astype(np.float32) / 255.0) for p in parts[0::2]]
    ys = [torch.from_numpy(p.astype(np.int64)) for p in parts[1::2]]
    return Dataset(xs[0], ys[0], xs[1], ys[1], 10)


class BatchPlan:
    """Which training samples worker `rank` uses at its step `step` (see module docstring)."""

    def __init__(self, labels: torch.Tensor, workers: int, per_worker: int, seed: int,
                 noniid: bool = False) -> None:
        n = int(labels.shape[0])
        self.workers, self.per_worker, self.seed = workers, per_worker, seed
        if noniid:
            order = torch.argsort(labels, stable=True)
            self.parts = [order[r * n // workers:(r + 1) * n // workers] for r in range(workers)]
            if any(len(p) < per_worker for p in self.parts):
                raise ValueError(f"non-IID shards of {n // workers} samples are smaller than a batch of {per_worker}")
        else:
            self.parts = None
            if n < workers * per_worker:
                raise ValueError(f"global batch {workers * per_worker} exceeds the {n} training samples")
        self.n = n
        self._perm_cache: dict[tuple[int, int], torch.Tensor] = {}

    def _perm(self, key: int, epoch: int, size: int) -> torch.Tensor:
        if (key, epoch) not in self._perm_cache:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 101 + key)
            self._perm_cache = {(key, epoch): torch.randperm(size, generator=g)}  # keep one epoch
        return self._perm_cache[(key, epoch)]

    def indices(self, rank: int, step: int) -> torch.Tensor:
        if self.parts is None:
            global_batch = self.workers * self.per_worker
            per_epoch = self.n // global_batch
            epoch, i = divmod(step, per_epoch)
            batch = self._perm(0, epoch, self.n)[i * global_batch:(i + 1) * global_batch]
            return batch[rank * self.per_worker:(rank + 1) * self.per_worker]
        part = self.parts[rank]
        per_epoch = len(part) // self.per_worker
        epoch, i = divmod(step, per_epoch)
        return part[self._perm(rank + 1, epoch, len(part))[i * self.per_worker:(i + 1) * self.per_worker]]
