"""`--model dlrm`: a small DLRM (Naumov et al. 2019) for `--dataset clicks`, and how psgd finds a
model's embedding tables.

Contract:
- `DLRM(vocab, dim, hidden)`: one `nn.Embedding(V_f, dim)` per categorical field; the F looked-up
  vectors, concatenated, and their F(F-1)/2 pairwise dot products (DLRM's interaction) feed a
  small MLP (one hidden layer of `hidden`, ReLU) that gives one logit z per sample. `forward(x)`
  takes x (batch, F) int64 ids and returns (batch, 2) logits (0, z): cross-entropy over them is
  exactly the logistic loss log(1 + exp(-z)) of a click, log(1 + exp(z)) of none, so the run's
  default loss, its accuracy and the dense path need nothing new. The clicks data has no dense
  features, so DLRM's bottom MLP is left out.
- `build(cfg, input_dim, num_classes)`: the registry's entry (psgd/train/models.py): the field
  count F = input_dim picks the click-log profile and its vocabularies
  (psgd/train/clicks.py `profile_for_fields`), `--width` is the embedding dimension (0: 16);
  ValueError for another dataset's shape.
- `embedding_tables(model)`: the model's `nn.Embedding` weights, as (parameter name, module)
  pairs in `named_parameters` order, for DLRM and for any user model (`--model FILE.py:FUNCTION`):
  the parameters a sparse exchange moves by row (psgd/core/rows.py) and a dense one moves whole.
  `sparse_fraction(model)` is the share of all parameters they hold. `DLRM.row_ids(x)`: the ids
  each table will read (a model that has it gets its rows pulled before forward, in one request
  per shard: needed for sync and SSP rows).

Initialisation: tables N(0, 0.05^2) (nn.Embedding's N(0, 1) makes the pairwise dots of 16-wide
vectors about 4 in size at the start, saturating the logit), linear layers torch's default.
"""

from __future__ import annotations

import torch
from torch import nn

from psgd.core.config import ModelConfig
from psgd.train import clicks

EMBED_DIM = 16   # --width 0
HIDDEN = 64      # the top MLP's hidden layer
INIT_STD = 0.05  # see the module docstring


class DLRM(nn.Module):
    def __init__(self, vocab: tuple[int, ...], dim: int = EMBED_DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        assert len(vocab) >= 2, "DLRM's interaction needs at least two fields"
        self.tables = nn.ModuleList(nn.Embedding(v, dim) for v in vocab)
        for t in self.tables:
            nn.init.normal_(t.weight, 0.0, INIT_STD)
        f = len(vocab)
        rows, cols = torch.triu_indices(f, f, offset=1)
        # Constants built identically in every process: not persistent (psgd syncs parameters only).
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)
        self.top = nn.Sequential(nn.Linear(f * dim + len(rows), hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def row_ids(self, x: torch.Tensor) -> dict[int, torch.Tensor]:
        """The ids each table will read for inputs x: table f reads column f (what a sparse
        exchange pulls before forward, psgd/train/rowexchange.py)."""
        return {f: x[:, f] for f in range(len(self.tables))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.stack([t(x[:, f]) for f, t in enumerate(self.tables)], dim=1)   # (B, F, d)
        dots = torch.bmm(e, e.transpose(1, 2))[:, self.pair_rows, self.pair_cols]  # (B, F(F-1)/2)
        z = self.top(torch.cat([e.flatten(1), dots], dim=1))                       # (B, 1)
        return torch.cat([torch.zeros_like(z), z], dim=1)


def build(cfg: ModelConfig, input_dim: int, num_classes: int) -> DLRM:
    if num_classes != 2:
        raise ValueError(f"--model dlrm predicts clicks (2 classes); this dataset has {num_classes} classes: "
                         f"give --dataset {' or '.join(clicks.PROFILES)}")
    try:
        profile = clicks.profile_for_fields(input_dim)
    except ValueError as e:
        raise ValueError(f"--model dlrm is sized by its click-log dataset: {e}") from None
    return DLRM(profile.vocab, cfg.width or EMBED_DIM)


def embedding_tables(model: nn.Module) -> list[tuple[str, nn.Embedding]]:
    """(the weight's parameter name, the module) of every nn.Embedding, in parameter order."""
    owner = {id(m.weight): m for m in model.modules() if isinstance(m, nn.Embedding)}
    return [(name, owner[id(p)]) for name, p in model.named_parameters() if id(p) in owner]


def sparse_fraction(model: nn.Module) -> float:
    """The share of the model's parameters held in embedding tables."""
    total = sum(p.numel() for p in model.parameters())
    return sum(m.weight.numel() for _, m in embedding_tables(model)) / max(1, total)
