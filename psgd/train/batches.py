"""The per-worker split of each global batch: which training samples worker r uses at step t.

Contract:
- `BatchPlan` fixes the sequence of global batches from (seed, global batch size) alone:
  epoch e is a seeded permutation of the training set, cut into global batches (the last
  partial batch is dropped). Worker r takes slice r of global batch t, so 4 workers x batch 8
  see exactly the samples of 1 worker x batch 32. With `noniid`, the training set is sorted by
  label and cut into N contiguous parts; worker r draws its batches from part r only. With
  `dirichlet` (label skew, Hsu et al. 2019 "Measuring the effects of non-identical data
  distribution"), each class's samples are split among the N workers in proportions drawn from
  Dir(alpha x 1_N) (numpy, seeded by the run seed), and worker r draws from the union of its
  pieces: alpha -> infinity is IID, alpha -> 0 puts each class on (nearly) one worker. A part
  smaller than one batch is topped up from the largest part (`dirichlet_parts`). With
  `dirichlet-equal` every worker holds floor(n / N) samples and its class mix is Dir(alpha)
  (`dirichlet_equal_parts`): the workers' parts weigh as many samples each. In the
  partitioned cases worker r takes its own seeded permutation of its part each epoch, cycling.
- `plan_for(cfg, labels)` builds the plan of a run; `class_histogram(plan, labels, classes)`
  counts the labels each worker draws from (the data a worker sees; for plotting skew).
- Pure functions of their arguments (labels, workers, batch, seed); the datasets themselves are
  psgd/train/data.py's, which re-exports these names.
"""

from __future__ import annotations

import numpy as np
import torch

from psgd.core.config import RunConfig

__all__ = ["BatchPlan", "plan_for", "dirichlet_parts", "dirichlet_equal_parts", "class_histogram"]


class BatchPlan:
    """Which training samples worker `rank` uses at its step `step` (see module docstring).

    `noniid`: label-sorted contiguous parts; `dirichlet_alpha`: Dirichlet label-skewed parts
    (`dirichlet_parts`); neither: IID slices of each global batch.
    """

    def __init__(self, labels: torch.Tensor, workers: int, per_worker: int, seed: int,
                 noniid: bool = False, dirichlet_alpha: float | None = None, equal: bool = False) -> None:
        n = int(labels.shape[0])
        self.workers, self.per_worker, self.seed = workers, per_worker, seed
        assert not (noniid and dirichlet_alpha is not None), "noniid and dirichlet are two different splits"
        if noniid:
            order = torch.argsort(labels, stable=True)
            self.parts = [order[r * n // workers:(r + 1) * n // workers] for r in range(workers)]
            if any(len(p) < per_worker for p in self.parts):
                raise ValueError(f"non-IID shards of {n // workers} samples are smaller than a batch of {per_worker}")
        elif dirichlet_alpha is not None:
            self.parts = (dirichlet_equal_parts(labels, workers, dirichlet_alpha, seed, min_size=per_worker) if equal
                          else dirichlet_parts(labels, workers, dirichlet_alpha, seed, min_size=per_worker))
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

    def samples_of(self, rank: int) -> torch.Tensor:
        """The training samples worker `rank` draws from: its part, or (IID) its slices of epoch 0."""
        if self.parts is not None:
            return self.parts[rank]
        steps = self.n // (self.workers * self.per_worker)
        return torch.cat([self.indices(rank, t) for t in range(steps)])


def plan_for(cfg: RunConfig, labels: torch.Tensor) -> BatchPlan:
    """The batch plan of a run: a worker's batch is --batch-size x --accumulate samples."""
    shard = cfg.data.shard_data
    return BatchPlan(labels, cfg.slots, cfg.batch_size * cfg.accumulate, cfg.seed, noniid=shard == "noniid",
                     dirichlet_alpha=cfg.data.dirichlet_alpha if shard.startswith("dirichlet") else None,
                     equal=shard == "dirichlet-equal")


def dirichlet_parts(labels: torch.Tensor, workers: int, alpha: float, seed: int,
                    min_size: int = 1) -> list[torch.Tensor]:
    """Split the samples among `workers` with Dirichlet label skew (Hsu et al. 2019).

    For each class c (in label order): its samples, in a seeded random order, are cut among the
    workers in proportions p_c ~ Dir(alpha x 1_N); worker r's part is the union of its pieces
    (in class order). numpy's Generator, seeded from `seed`, draws everything, so the split is a pure
    function of (labels, workers, alpha, seed).

    Fix-up: with a small alpha a worker may get (almost) nothing. While some part holds fewer
    than `min_size` samples (one batch), the last samples of the largest part (ties: the lowest
    rank), that is of its last class, move to the smallest one (ties: the lowest rank), as many as
    it lacks or as the largest can spare above `min_size`. Deterministic, and it leaves the skew
    of every other part alone. ValueError when the samples cannot fill N parts of min_size.
    """
    n = int(labels.shape[0])
    if n < workers * min_size:
        raise ValueError(f"{n} training samples cannot give {workers} workers a batch of {min_size} each")
    rng = np.random.default_rng([seed % (1 << 63), 0xD1])  # a stream of its own, apart from batch order
    y = labels.cpu().numpy()
    # Each part lists its pieces in class order, so the fix-up below moves its last class first.
    pieces: list[list[np.ndarray]] = [[] for _ in range(workers)]
    for c in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == c))
        shares = rng.dirichlet(np.full(workers, alpha))
        cuts = (np.cumsum(shares)[:-1] * len(members)).astype(np.int64)
        for r, piece in enumerate(np.split(members, cuts)):
            pieces[r].append(piece)
    parts = [np.concatenate(p) for p in pieces]
    while True:
        sizes = [len(p) for p in parts]
        small = int(np.argmin(sizes))
        if sizes[small] >= min_size:
            break
        big = int(np.argmax(sizes))
        move = min(min_size - sizes[small], sizes[big] - min_size)
        assert move > 0, "n >= workers x min_size leaves the largest part something to spare"
        parts[small] = np.concatenate([parts[small], parts[big][-move:]])
        parts[big] = parts[big][:-move]
    return [torch.from_numpy(p.astype(np.int64)) for p in parts]


def dirichlet_equal_parts(labels: torch.Tensor, workers: int, alpha: float, seed: int,
                          min_size: int = 1) -> list[torch.Tensor]:
    """Split the samples into `workers` parts of one size, floor(n / N), each with its own label
    skew: worker r's class mix q_r ~ Dir(alpha x 1_C) (Hsu et al. 2019's clients, which all hold
    as many samples). Worker by worker (rank order), its n / N samples are drawn class by class in
    proportion to q_r from what the workers before it left; a class that runs out gives its share
    to the classes still there, in proportion to q_r. So every worker's gradient stands for as
    many samples, and the mean of the N gradients weights the classes as the data does, up to
    the floor(n / N) remainder (samples left out). Pure function of (labels, workers, alpha, seed);
    ValueError when a part would be smaller than `min_size`."""
    n = int(labels.shape[0])
    size = n // workers
    if size < min_size:
        raise ValueError(f"{n} training samples cannot give {workers} workers a batch of {min_size} each")
    rng = np.random.default_rng([seed % (1 << 63), 0xE7])
    y = labels.cpu().numpy()
    classes = np.unique(y)
    pools = [list(rng.permutation(np.flatnonzero(y == c))) for c in classes]
    parts = []
    for _ in range(workers):
        q = rng.dirichlet(np.full(len(classes), alpha))
        take = np.zeros(len(classes), dtype=np.int64)
        need = size
        while need:
            left = np.array([len(p) for p in pools]) - take
            w = np.where(left > 0, q, 0.0)
            w = w / w.sum() if w.sum() > 0 else (left > 0) / max(1, (left > 0).sum())
            want = np.minimum(np.floor(w * need).astype(np.int64), left)
            if want.sum() == 0:  # less than one sample each: the largest weights take one
                for c in np.argsort(-w, kind="stable")[:need]:
                    if left[c] > 0:
                        want[c] += 1
            want = np.minimum(want, left)
            take += want
            need -= int(want.sum())
        piece = []
        for c, k in enumerate(take):
            piece += pools[c][:k]
            pools[c] = pools[c][k:]
        parts.append(torch.tensor(piece, dtype=torch.int64))
    return parts


def class_histogram(plan: BatchPlan, labels: torch.Tensor, num_classes: int) -> list[list[int]]:
    """counts[r][c]: samples of class c among those worker r draws from (`BatchPlan.samples_of`)."""
    return [torch.bincount(labels[plan.samples_of(r)], minlength=num_classes).tolist()
            for r in range(plan.workers)]
