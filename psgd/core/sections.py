"""The config schema's nested sections: `DataConfig`, `ModelConfig`, `OptimConfig`, each with its checks.

`RunConfig` (psgd/core/schema.py) holds one of each (`cfg.data`, `cfg.model`, `cfg.optim`); their
leaf names are flags and TOML keys like the run's own (psgd/core/flags.py). `check_data`,
`check_model` and `check_optim` are `validate`'s checks of one section (psgd/core/config.py):
(ok, one-line message naming the flag) pairs. Stdlib only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from psgd.core.flags import is_spec, opt

DATASETS = ("synthetic", "mnist1d", "mnist", "text", "clicks", "clicks-medium", "clicks-large")
MODELS = ("logreg", "mlp", "cnn", "wide_mlp", "gpt", "dlrm")
LOSSES = ("cross_entropy", "mse")
# The optimizers by name, the one registry of them (psgd/core/optim.py builds from it): a class, or
# "module:Class" for one imported only by a run that takes it. The --optimizer flag's choices are
# this dict itself, so a name registered at run time is a choice too. Here, not in optim.py,
# because this module is stdlib only (the flags are built without importing torch).
OPTIMIZERS: dict[str, str | type] = {"sgd": "psgd.core.optim:SGD", "adamw": "psgd.core.adamw:AdamW"}
OUTERS = ("sgd", "nesterov")
SHARD_DATA = ("iid", "noniid", "dirichlet", "dirichlet-equal")

Check = tuple[bool, str]  # (ok, the ValueError's message when not)


# -- the schema ----------------------------------------------------------------------------------
# GROUP is the section's title in `psgd run -h`; sections that share a title share the group.
@dataclass(frozen=True)
class DataConfig:
    GROUP: ClassVar[str] = "data and model"
    dataset: str = opt("synthetic", f"training data: {', '.join(DATASETS)}, or your own as MODULE:FUNCTION or "
                                    "FILE.py:FUNCTION, a callable returning (train, test), each a tuple (x, y) of "
                                    "tensors or a map-style torch Dataset (psgd/train/userspec.py)",
                       metavar="NAME|SPEC")
    data_dir: str = opt("", "MNIST IDX files; mnist1d cache (default ~/.cache/psgd)")
    num_samples: int = opt(5000, "samples to generate (80% train)")   # synthetic / mnist1d; the rest is test
    data_seed: int = opt(42, "seed of the generated dataset")          # kept apart from --seed
    shard_data: str = opt("iid", "noniid: sort by label, worker r trains on part r only; dirichlet: each class "
                                 "split among workers in Dir(alpha) shares; dirichlet-equal: every worker as many "
                                 "samples, its class mix drawn from Dir(alpha) (Hsu et al. 2019's clients)",
                          choices=SHARD_DATA)
    dirichlet_alpha: float = opt(1.0, "dirichlet label skew: 100 is nearly IID, 0.1 gives most workers a few "
                                      "classes", metavar="ALPHA")
    val_fraction: float = opt(0.0, "hold this fraction of the training set out as a validation split (LR tuning)")

    def cache_path(self) -> Path | None:
        """Where a generated dataset is cached (mnist1d; None for the others): psgd/train/data.py
        writes it, and `psgd run` looks for it without importing torch."""
        if self.dataset != "mnist1d":
            return None
        root = Path(self.data_dir) if self.data_dir else Path.home() / ".cache" / "psgd"
        return root / f"mnist1d-n{self.num_samples}-seed{self.data_seed}.npz"


@dataclass(frozen=True)
class ModelConfig:
    GROUP: ClassVar[str] = "data and model"
    model: str = opt("mlp", f"model to train: {', '.join(MODELS)} (cnn is 1-D, for mnist1d), or your own as "
                            "MODULE:FUNCTION or FILE.py:FUNCTION, a callable of no required arguments returning "
                            "an nn.Module", metavar="NAME|SPEC")
    width: int = opt(0, "hidden width (0: the model's own: mlp 128, wide_mlp 1024, cnn 32 channels, gpt 128; "
                        "dlrm: its embedding dimension, 16)")
    layers: int = opt(2, "gpt: transformer blocks")
    heads: int = opt(4, "gpt: attention heads (a divisor of --width)")
    loss: str = opt("cross_entropy", f"training loss: {', '.join(LOSSES)}, or MODULE:FUNCTION / FILE.py:FUNCTION "
                                     "taking (output, target) and returning a scalar tensor; accuracy is reported "
                                     "with cross_entropy only", metavar="NAME|SPEC")


@dataclass(frozen=True)
class OptimConfig:
    GROUP: ClassVar[str] = "optimizer (applied by the servers or every replica: psgd/core/optim.py)"
    optimizer: str = opt("sgd", "sgd (torch.optim.SGD's update) or adamw (torch.optim.AdamW's)", choices=OPTIMIZERS)
    lr: float = opt(0.05, "learning rate")
    momentum: float = opt(0.9, "SGD momentum")
    weight_decay: float = opt(0.0, "weight decay: L2 in sgd, decoupled in adamw")
    warmup: int = opt(0, "linear LR warmup over this many updates")   # Goyal et al. 2017
    beta1: float = opt(0.9, "adamw: first-moment decay")                # torch.optim.AdamW's defaults
    beta2: float = opt(0.999, "adamw: second-moment decay")
    eps: float = opt(1e-8, "adamw: epsilon added to the denominator")
    nesterov: bool = opt(False, "sgd: Nesterov momentum (torch.optim.SGD's nesterov=True)")
    # The outer optimizer of --local-steps H > 1 (psgd/core/localsgd.py): applied to the mean of the
    # workers' parameter changes every H steps. sgd at lr 1 without momentum is plain local SGD (the
    # replicas' average); nesterov is DiLoCo's (Douillard et al. 2023: lr 0.7, momentum 0.9).
    outer: str = opt("sgd", "local SGD's outer optimizer: sgd (lr 1: the replicas' average) or nesterov (DiLoCo)",
                     choices=OUTERS)
    outer_lr: float = opt(0.0, "the outer optimizer's rate (0: its own default, sgd 1.0, nesterov 0.7)")
    outer_momentum: float = opt(0.0, "the outer optimizer's momentum (0: its own default, sgd 0, nesterov 0.9)")


def check_data(d: DataConfig) -> list[Check]:
    return [
        (d.dataset in DATASETS or is_spec(d.dataset),
         f"--dataset must be one of {', '.join(DATASETS)} or MODULE:FUNCTION / FILE.py:FUNCTION, got "
         f"{d.dataset!r}"),
        (d.num_samples >= 10, f"--num-samples must be >= 10, got {d.num_samples}"),
        (d.shard_data in SHARD_DATA, f"--shard-data must be one of {', '.join(SHARD_DATA)}"),
        (d.dirichlet_alpha > 0 and math.isfinite(d.dirichlet_alpha),
         f"--dirichlet-alpha must be > 0, got {d.dirichlet_alpha}"),
        (0 <= d.val_fraction < 1, f"--val-fraction must be in [0, 1), got {d.val_fraction}"),
    ]


def check_model(m: ModelConfig) -> list[Check]:
    return [
        (m.model in MODELS or is_spec(m.model),
         f"--model must be one of {', '.join(MODELS)} or MODULE:FUNCTION / FILE.py:FUNCTION, got {m.model!r}"),
        (m.loss in LOSSES or is_spec(m.loss),
         f"--loss must be one of {', '.join(LOSSES)} or MODULE:FUNCTION / FILE.py:FUNCTION, got {m.loss!r}"),
        (m.width >= 0, f"--width must be >= 0, got {m.width}"),
        (m.layers >= 1 and m.heads >= 1 and (m.width or 128) % m.heads == 0,
         f"--layers and --heads must be >= 1 and --heads must divide --width (gpt: {m.width or 128}), got "
         f"--layers {m.layers} --heads {m.heads}"),
    ]


def check_optim(o: OptimConfig) -> list[Check]:
    """The optimizer's own settings (the outer step's need of --local-steps: config.py `_check_local_sgd`)."""
    return [
        (o.optimizer in OPTIMIZERS, f"--optimizer must be one of {', '.join(OPTIMIZERS)}"),
        (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1,
         f"--beta1 and --beta2 must be in [0, 1), got {o.beta1} and {o.beta2}"),
        (o.eps > 0 and math.isfinite(o.eps), f"--eps must be > 0, got {o.eps}"),
        (o.outer in OUTERS, f"--outer must be one of {', '.join(OUTERS)}"),
        (o.outer_lr >= 0 and math.isfinite(o.outer_lr), f"--outer-lr must be >= 0, got {o.outer_lr}"),
        (0 <= o.outer_momentum < 1, f"--outer-momentum must be in [0, 1), got {o.outer_momentum}"),
        (not o.nesterov or (o.optimizer == "sgd" and o.momentum > 0),
         "--nesterov is SGD's Nesterov momentum: it needs --optimizer sgd and --momentum > 0"),
        (o.lr > 0 and math.isfinite(o.lr), f"--lr must be > 0, got {o.lr}"),
        (0 <= o.momentum < 1, f"--momentum must be in [0, 1), got {o.momentum}"),
        (o.weight_decay >= 0, f"--weight-decay must be >= 0, got {o.weight_decay}"),
        (o.warmup >= 0, f"--warmup must be >= 0, got {o.warmup}"),
    ]
