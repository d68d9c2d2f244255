"""`--dataset clicks`: synthetic click logs, seeded and generated offline, for the sparse (recommender) case.

What a sample is: F categorical fields, field f an id in [0, V_f) of its own vocabulary, and a
click label in {0, 1}. Like MNIST-1D, the data is made by a fixed program from a seed, never
downloaded: `generate(profile, num_samples, seed)` is a pure function of its arguments (numpy's
PCG64, seeded), so every worker and shard process makes the same logs.

- Ids: field f draws from a bounded Zipf law, P(id = k) proportional to 1 / (k + 1)^s over its
  V_f ids, with exponent s = `Profile.zipf` (1.1 by default: a few hot ids take most lookups and a
  long tail is seen rarely, the shape of real click logs; Adnan et al. 2021 measure Criteo's fields
  near such power laws). Id k is the (k + 1)-th most frequent: id 0 is the hottest of its field, so
  a partition by range of ids puts every field's hot ids on the first shard (psgd/core/rows.py).
- Label: a hidden teacher, a factorisation machine (Rendle 2010) with its own seeded embeddings:
  logit = b + sum_f w_f[id_f] + sum_{f<g} <v_f[id_f], v_g[id_g]>, and the label is a draw from
  Bernoulli(sigmoid(logit)) (the noise: logistic, so even the teacher cannot be always right;
  `teacher_auc` is the ceiling a model can reach). b is set so that about `ctr` of the samples click.
- Splits: the first 80% of the samples train and the rest test (data.TRAIN_FRACTION, as for the
  other generated sets); `--val-fraction` carves validation out of the training part (data.py).
- Sizes: `PROFILES` by dataset name, `clicks` small (the default, for the 2-core suite), and
  `clicks-medium`, `clicks-large` (about 10^6 ids in all); `--num-samples` sets the sample count.
  Each profile has its own field count, so a model sized from the input width alone (data.SHAPES,
  what a shard server knows) finds its vocabularies: `profile_for_fields(F)`.

x is int64 (n, F) local ids (per field), y int64 labels (cross-entropy over 2 classes is the
logistic loss; `--model dlrm` answers with the logits (0, z)). Tests: tests/test_clicks.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Profile:
    """One size of click logs: the vocabularies and how ids and labels are drawn."""
    vocab: tuple[int, ...]      # ids per field, V_f (the field count F is its length)
    zipf: float = 1.1           # exponent s of every field's bounded Zipf law
    teacher_dim: int = 4        # the teacher FM's embedding dimension
    teacher_scale: float = 0.6  # std of its pairwise factors (and of its first-order weights)
    ctr: float = 0.3            # the click rate the teacher's bias aims at

    @property
    def fields(self) -> int:
        return len(self.vocab)

    @property
    def ids(self) -> int:
        return sum(self.vocab)


# Field counts differ between profiles on purpose: see `profile_for_fields`. Vocabularies span the
# spread of real logs (a field of a few values beside one of many): Criteo's 26 fields range from 3
# to about 10^7 ids.
PROFILES: dict[str, Profile] = {
    "clicks": Profile((500, 300, 200, 100, 50, 20, 10, 5)),
    "clicks-medium": Profile((20000, 10000, 5000, 5000, 2000, 2000, 1000, 1000, 500, 200, 100, 50, 10)),
    "clicks-large": Profile((300000, 200000, 150000, 100000, 80000, 50000, 40000, 30000, 20000, 10000, 8000,
                             5000, 3000, 2000, 1000, 800, 500, 300, 200, 100, 50, 30, 20, 10, 5, 3)),
}


def profile_for_fields(fields: int) -> Profile:
    """The profile whose samples have `fields` fields; ValueError naming the choices otherwise."""
    for p in PROFILES.values():
        if p.fields == fields:
            return p
    known = ", ".join(f"{name} ({p.fields})" for name, p in PROFILES.items())
    raise ValueError(f"no click-log profile has {fields} fields; the datasets and their field counts: {known}")


def zipf_probabilities(vocab: int, s: float) -> np.ndarray:
    """P(id = k) for k < vocab, proportional to 1 / (k + 1)^s (float64, sums to 1)."""
    w = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** s
    return w / w.sum()


def draw_ids(rng: np.random.Generator, vocab: int, s: float, n: int) -> np.ndarray:
    """n ids of one field by inverse CDF (exact for a bounded law; numpy's own zipf is unbounded)."""
    cdf = np.cumsum(zipf_probabilities(vocab, s))
    cdf[-1] = 1.0  # rounding must not leave a u above the last bucket
    return np.searchsorted(cdf, rng.random(n), side="right").astype(np.int64)


@dataclass(frozen=True)
class Teacher:
    """The hidden FM: first-order weights and factors per field, and the bias."""
    w: tuple[np.ndarray, ...]   # (V_f,) per field
    v: tuple[np.ndarray, ...]   # (V_f, teacher_dim) per field
    bias: float

    def logits(self, x: np.ndarray) -> np.ndarray:
        """The FM's logit of every sample of x (n, F); the pairwise sum by the square trick:
        sum_{f<g} <a_f, a_g> = (|sum_f a_f|^2 - sum_f |a_f|^2) / 2."""
        first = sum(w[x[:, f]] for f, w in enumerate(self.w))
        vs = np.stack([v[x[:, f]] for f, v in enumerate(self.v)], axis=1)  # (n, F, k)
        pair = 0.5 * ((vs.sum(axis=1) ** 2).sum(axis=1) - (vs ** 2).sum(axis=(1, 2)))
        return self.bias + first + pair


def make_teacher(profile: Profile, rng: np.random.Generator, x_probe: np.ndarray) -> Teacher:
    """The teacher's weights, its bias set so that the mean click probability on `x_probe` is about
    `profile.ctr` (a few bisection steps on the bias; the logits are monotone in it)."""
    sd = profile.teacher_scale
    w = tuple(rng.normal(0.0, sd, size=v) for v in profile.vocab)
    # Pairwise terms add up over F(F-1)/2 pairs: each factor's scale shrinks so the sum's spread
    # stays about sd whatever F is.
    pair_sd = sd / max(1.0, (profile.fields * (profile.fields - 1) / 2) ** 0.25) / profile.teacher_dim ** 0.25
    v = tuple(rng.normal(0.0, pair_sd, size=(vocab, profile.teacher_dim)) for vocab in profile.vocab)
    raw = Teacher(w, v, 0.0).logits(x_probe)
    lo, hi = -20.0, 20.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if _sigmoid(raw + mid).mean() < profile.ctr:
            lo = mid
        else:
            hi = mid
    return Teacher(w, v, (lo + hi) / 2)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


@dataclass(frozen=True)
class Logs:
    """Generated click logs: x (n, F) int64 ids, y (n,) int64 labels, p (n,) the teacher's click
    probabilities (what the Bayes-optimal model would predict)."""
    x: np.ndarray
    y: np.ndarray
    p: np.ndarray


def generate(profile: Profile, num_samples: int, seed: int) -> Logs:
    """`num_samples` click-log samples of `profile`, a pure function of (profile, num_samples, seed).
    Each field's ids, the teacher's weights and the label noise come from streams of their own
    (seeded from `seed`), so growing num_samples extends the same logs and keeps the teacher."""
    teacher_rng, noise_rng = (np.random.default_rng([seed, 0xC11C, k]) for k in (1, 2))
    x = np.stack([draw_ids(np.random.default_rng([seed, 0xC11C, 0, f]), v, profile.zipf, num_samples)
                  for f, v in enumerate(profile.vocab)], axis=1)
    probe = np.stack([draw_ids(np.random.default_rng([seed, 0xC11C, 3, f]), v, profile.zipf, 4096)
                      for f, v in enumerate(profile.vocab)], axis=1)
    teacher = make_teacher(profile, teacher_rng, probe)
    p = _sigmoid(teacher.logits(x))
    y = (noise_rng.random(num_samples) < p).astype(np.int64)
    return Logs(x, y, p)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (the Mann-Whitney U statistic, ties counted half); 0.5 is chance.
    NaN when only one class is present."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels)
    pos, neg = int((labels == 1).sum()), int((labels == 0).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    # Ranks averaged over ties (1-based), so that equal scores count half either way.
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2.0)[inverse]
    return float((ranks[labels == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def teacher_auc(logs: Logs) -> float:
    """The teacher's own AUC on these labels: the ceiling of any model (the noise is the rest)."""
    return auc(logs.p, logs.y)
