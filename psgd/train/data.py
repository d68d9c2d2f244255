"""Datasets and the per-worker split of each global batch.

Contract:
- `load(cfg)` returns a `Dataset` of float32 inputs and int64 labels, train, validation and
  test: `synthetic` (a seeded teacher network labels Gaussian inputs; fast, the test default),
  `mnist1d` (the MNIST-1D benchmark, Greydanus 2020, generated offline by the `mnist1d`
  package's make_dataset and cached as .npz; `--num-samples` may exceed its default 5,000),
  `mnist` (standard IDX files, optionally gzipped, from `--data-dir`, default ~/.cache/psgd as for
  the mnist1d cache; `missing_files` says which are not there, and where to get them), and `text` (character
  windows of the English text that ships with CPython, psgd/train/text.py; its validation split is
  10% of the text by position, whatever `--val-fraction` says), and `clicks`, `clicks-medium`,
  `clicks-large` (seeded click logs, int64 ids per categorical field: psgd/train/clicks.py).
- Validation split (`--val-fraction f`): carved out of the TRAINING set, never the test set, so
  a learning rate tuned on it never sees the test set. A permutation seeded by `data_seed`
  alone (not `--seed`: every run of one dataset holds out the same samples) picks
  `round(f * n)` samples as `x_val / y_val`; the rest stay the training set, in their original
  order. f = 0 leaves the training set untouched and the validation tensors empty.
  `train_size(cfg)` is the training set's size after the split (what `--epochs` counts).
- The split of each global batch among the workers (`BatchPlan`, `plan_for`, `class_histogram`:
  IID slices, or label-skewed parts) is psgd/train/batches.py's, re-exported here as `data.BatchPlan`
  and so on, the names the examples and docs use.
- Your own data (`--dataset pkg.mod:make_data` or `FILE.py:make_data`, psgd/train/userspec.py):
  a callable of no required arguments returning `(train, test)`, each a tuple `(x, y)` of tensors
  of one length, or a map-style `torch.utils.data.Dataset` whose items are `(x, y)` pairs (read
  once into memory, `torch.stack`ed). Float inputs and targets become float32 (the parameters'
  dtype), integers stay (token ids); `num_classes` is max label + 1 for integer targets, else 0.
  The validation split applies as to the built-in sets. `user_data(spec)` does it; every bad
  return value is a one-line SpecError.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from psgd.core.config import DataConfig, is_spec
from psgd.train import userspec
from psgd.train.batches import BatchPlan, class_histogram, plan_for

__all__ = ["Dataset", "SHAPES", "load", "train_size", "user_data", "is_labels", "validation_count", "split_validation",
           "data_dir", "missing_files", "MNIST_FILES", "BatchPlan", "plan_for", "class_histogram"]

TRAIN_FRACTION = 0.8  # split of generated datasets (mnist1d's own default)
# (input features, classes) of each dataset, known without loading it: a shard server sizes the
# model from them (`psgd server` checks every Init header against that size).
SHAPES = {"synthetic": (32, 10), "mnist1d": (40, 10), "mnist": (784, 10),
          "text": (64, 103),  # text: tokens per window, vocabulary
          "clicks": (8, 2), "clicks-medium": (13, 2), "clicks-large": (26, 2)}  # fields, click or not


@dataclass(frozen=True)
class Dataset:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    x_val: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # empty without --val-fraction
    y_val: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))

    @property
    def input_dim(self) -> int:
        return int(self.x_train[0].numel())


def load(cfg: DataConfig) -> Dataset:
    if is_spec(cfg.dataset):
        ds = user_data(cfg.dataset)
    elif cfg.dataset == "synthetic":
        ds = _synthetic(cfg.num_samples, cfg.data_seed)
    elif cfg.dataset == "mnist1d":
        ds = _mnist1d(cfg)
    elif cfg.dataset == "mnist":
        ds = _mnist_idx(data_dir(cfg))
    elif cfg.dataset == "text":
        from psgd.train import text  # noqa: PLC0415

        (xt, yt), (xv, yv), (xs, ys), vocab = text.load()
        return Dataset(xt, yt, xs, ys, vocab, x_val=xv, y_val=yv)  # validation by position, always (text.py)
    elif cfg.dataset.startswith("clicks"):
        ds = _clicks(cfg)
    else:
        raise ValueError(f"unknown dataset {cfg.dataset!r}")
    return split_validation(ds, cfg.val_fraction, cfg.data_seed)


def train_size(cfg: DataConfig) -> int:
    """Training-set size after the validation split, without loading the data when it can be
    derived (for --epochs)."""
    if not is_spec(cfg.dataset) and (cfg.dataset in ("synthetic", "mnist1d") or cfg.dataset.startswith("clicks")):
        n = int(cfg.num_samples * TRAIN_FRACTION)
        return n - validation_count(n, cfg.val_fraction)
    return int(load(cfg).x_train.shape[0])


def user_data(spec: str) -> Dataset:
    """The user's `(train, test)` as a Dataset (see the module docstring); SpecError when unusable."""
    fn = userspec.resolve(spec, "--dataset")
    try:
        got = fn()
    except Exception as e:  # noqa: BLE001 - the user's code: its error, in one line, is the message
        raise userspec.SpecError(f"--dataset {spec}: calling it failed: {type(e).__name__}: {e}") from None
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise userspec.SpecError(f"--dataset {spec} must return (train, test), got {_describe(got)}")
    (x_tr, y_tr), (x_te, y_te) = (_tensors(spec, part, name) for part, name in zip(got, ("train", "test"), strict=True))
    if x_tr.shape[1:] != x_te.shape[1:]:
        raise userspec.SpecError(f"--dataset {spec}: train inputs are {tuple(x_tr.shape[1:])} per sample, test "
                                 f"inputs {tuple(x_te.shape[1:])}")
    if is_labels(y_tr):
        classes = int(max(int(y_tr.max()), int(y_te.max()) if len(y_te) else 0)) + 1
    else:  # regression targets: a built-in model (--model mlp) gets one output per target value
        classes = int(y_tr[0].numel())
    return Dataset(x_tr, y_tr, x_te, y_te, classes)


def is_labels(y: torch.Tensor) -> bool:
    """Integer class labels (what cross-entropy, accuracy and the non-IID splits need)."""
    return not y.dtype.is_floating_point and not y.dtype.is_complex and y.dtype != torch.bool


def _describe(obj) -> str:
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)}"
    return f"a {type(obj).__name__}"


def _tensors(spec: str, part, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One split as (x, y) tensors of one length: from an (x, y) pair, or a map-style Dataset's items."""
    where = f"--dataset {spec}: the {name} split"
    if isinstance(part, (tuple, list)) and len(part) == 2 and all(isinstance(t, (torch.Tensor, np.ndarray))
                                                                   for t in part):
        x, y = (torch.as_tensor(t) for t in part)
    elif hasattr(part, "__getitem__") and hasattr(part, "__len__") and not isinstance(part, (tuple, list, str)):
        items = [part[i] for i in range(len(part))]
        if not items:
            raise userspec.SpecError(f"{where} is empty")
        if not all(isinstance(it, (tuple, list)) and len(it) == 2 for it in items):
            raise userspec.SpecError(f"{where}: a Dataset's items must be (x, y) pairs, item 0 is "
                                     f"{_describe(items[0])}")
        try:
            x = torch.stack([torch.as_tensor(it[0]) for it in items])
            y = torch.stack([torch.as_tensor(it[1]) for it in items])
        except (RuntimeError, TypeError) as e:
            raise userspec.SpecError(f"{where}: its items do not stack into tensors: {e}") from None
    else:
        raise userspec.SpecError(f"{where} must be a tuple (x, y) of tensors or a map-style torch Dataset, got "
                                 f"{_describe(part)}")
    if x.dim() == 0 or y.dim() == 0 or len(x) != len(y):
        raise userspec.SpecError(f"{where}: x has {len(x) if x.dim() else 0} samples, y has "
                                 f"{len(y) if y.dim() else 0}: they must have one length")
    if len(x) == 0 and name == "train":
        raise userspec.SpecError(f"{where} is empty")
    # The parameters are fp32 (models.FlatParams): float inputs and targets follow; integers stay.
    x, y = (t.float() if t.dtype.is_floating_point else t for t in (x, y))
    return x.contiguous(), y.contiguous()


def validation_count(n: int, fraction: float) -> int:
    """Samples of an n-sample training set held out for validation; ValueError if none would stay."""
    held = round(fraction * n)
    if held >= n:
        raise ValueError(f"--val-fraction {fraction} leaves none of the {n} training samples to train on")
    return held


def split_validation(ds: Dataset, fraction: float, data_seed: int) -> Dataset:
    """Move round(fraction x n) training samples, picked by a permutation seeded by data_seed,
    into the validation split; the others keep their order. fraction 0: empty validation."""
    n = int(ds.x_train.shape[0])
    held = validation_count(n, fraction)
    if held == 0:
        return dataclasses.replace(ds, x_val=ds.x_train[:0], y_val=ds.y_train[:0])
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(data_seed))
    keep, val = perm[:n - held].sort().values, perm[n - held:]
    return dataclasses.replace(ds, x_train=ds.x_train[keep], y_train=ds.y_train[keep],
                               x_val=ds.x_train[val], y_val=ds.y_train[val])


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
    path = cfg.cache_path()
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


def _clicks(cfg: DataConfig) -> Dataset:
    """Seeded click logs (psgd/train/clicks.py): int64 ids per field, click labels; 80% train."""
    from psgd.train import clicks  # noqa: PLC0415

    logs = clicks.generate(clicks.PROFILES[cfg.dataset], cfg.num_samples, cfg.data_seed)
    x, y = torch.from_numpy(logs.x), torch.from_numpy(logs.y)
    cut = int(cfg.num_samples * TRAIN_FRACTION)
    return Dataset(x[:cut], y[:cut], x[cut:], y[cut:], 2)


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    shape = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
MNIST_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"  # torchvision's mirror of Yann LeCun's files


def data_dir(cfg: DataConfig) -> Path:
    """Where datasets read from files are looked for: --data-dir, default ~/.cache/psgd (the folder
    `psgd run -h` names, where the mnist1d cache goes too)."""
    return Path(cfg.data_dir).expanduser() if cfg.data_dir else Path.home() / ".cache" / "psgd"


def missing_files(cfg: DataConfig) -> str | None:
    """None when --dataset mnist's four IDX files are in `data_dir` (plain or .gz); else one line
    naming the folder, the missing files and how to fetch them (psgd run refuses before it starts)."""
    root = data_dir(cfg)
    missing = [stem for stem in MNIST_FILES if not any((root / n).is_file() for n in (stem, stem + ".gz"))]
    if not missing:
        return None
    return (f"--dataset mnist: {root} has no {', '.join(f + '[.gz]' for f in missing)}; download them "
            f"there (curl -O {MNIST_URL}NAME.gz for each), or give --data-dir FOLDER that holds them")


def _mnist_idx(root: Path) -> Dataset:
    def find(stem: str) -> Path:
        for name in (stem, stem + ".gz"):
            if (root / name).exists():
                return root / name
        raise FileNotFoundError(f"MNIST file {stem}[.gz] not found in --data-dir {root}")

    parts = [_read_idx(find(s)) for s in MNIST_FILES]
    xs = [torch.from_numpy(p.reshape(p.shape[0], -1).astype(np.float32) / 255.0) for p in parts[0::2]]
    ys = [torch.from_numpy(p.astype(np.int64)) for p in parts[1::2]]
    return Dataset(xs[0], ys[0], xs[1], ys[1], 10)
