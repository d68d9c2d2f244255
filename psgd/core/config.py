"""Run configuration: frozen dataclasses, validated once at the edge, dumped to config.json.

Every field of these dataclasses is a command-line flag of `psgd run | server | worker` with
the same name (`batch_size` <-> `--batch-size`), so `to_argv(cfg)` renders a config back into
the flags that rebuild it: that is how `psgd run` hands the exact same configuration to the
server and worker processes it starts (and how you would start them by hand on other hosts).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from psgd.core import link

PS_MODES = ("sync", "async", "ssp")
MODES = PS_MODES + ("allreduce",)
DATASETS = ("synthetic", "mnist1d", "mnist")
MODELS = ("logreg", "mlp", "cnn", "wide_mlp")
WIRE_DTYPES = ("fp32", "fp16", "bf16")
DEVICES = ("auto", "cpu", "cuda")
ALLREDUCE_IMPLS = ("library", "ring")
BACKENDS = ("auto", "gloo", "nccl")
TRANSPORTS = ("grpc", "tcp")
SHARD_DATA = ("iid", "noniid", "dirichlet")


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "synthetic"      # synthetic | mnist1d | mnist (IDX files from --data-dir)
    data_dir: str = ""              # where MNIST IDX files live; also the mnist1d cache ("" = ~/.cache/psgd)
    num_samples: int = 5000         # synthetic / mnist1d: samples generated, split 80% train / 20% test
    data_seed: int = 42             # seed of the generated dataset (kept apart from --seed)
    shard_data: str = "iid"         # iid: slice r of each global batch | noniid: label-sorted parts | dirichlet
    dirichlet_alpha: float = 1.0    # dirichlet: label skew, class shares per worker ~ Dir(alpha) (small = skewed)
    val_fraction: float = 0.0       # held out of the training set as a validation split (for LR tuning)


@dataclass(frozen=True)
class ModelConfig:
    model: str = "mlp"              # logreg | mlp | cnn (1-D, for mnist1d) | wide_mlp
    width: int = 0                  # hidden width; 0 = the model's default (mlp 128, wide_mlp 1024)


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 0.05                # SGD learning rate (applied by the servers, or by every replica)
    momentum: float = 0.9
    weight_decay: float = 0.0
    warmup: int = 0                 # linear LR warmup over this many updates (Goyal et al. 2017)


@dataclass(frozen=True)
class RunConfig:
    mode: str = "sync"              # sync | async | ssp | allreduce
    workers: int = 2
    servers: int = 1                # parameter shards (PS modes)
    staleness: int = 2              # SSP bound s
    steps: int = 100                # budget: steps x workers gradients applied in total
    epochs: float = 0.0             # if > 0, overrides steps: epochs over the training set
    batch_size: int = 32            # per worker, per micro-batch
    accumulate: int = 1             # local micro-batches per push (gradient accumulation)
    local_steps: int = 1            # local SGD: H optimizer steps on the replica between averagings (sync, allreduce)
    seed: int = 0                   # model init and batch order
    eval_every: int = 20            # servers snapshot parameters every this many updates (0 = end only)
    device: str = "auto"            # auto | cpu | cuda
    wire_dtype: str = "fp32"        # fp32 | fp16 | bf16 on the wire; servers accumulate in fp32
    straggler: tuple[tuple[int, int], ...] = ()   # (rank, ms): fixed extra delay per step
    jitter: float = 0.0             # mean of an exponential random delay per step, every worker (ms)
    skip_nonfinite: bool = False    # skip (and count) non-finite gradients instead of rejecting them
    rpc_timeout: float = 60.0       # seconds; deadline of every RPC, including a pull held by SSP/sync
    fail_at: tuple[tuple[int, int], ...] = ()     # (rank, step): fault injection, rank kills itself
    allreduce_impl: str = "library"  # allreduce: library (torch.distributed) | ring (psgd/allreduce/ring.py, by hand)
    bucket_mb: float = 25.0         # allreduce: gradient bucket size in MiB (PyTorch DDP's default, 25)
    backend: str = "auto"           # allreduce: auto (nccl with one GPU per rank, else gloo) | gloo | nccl
    check_every: int = 50           # allreduce: compare replica hashes every this many updates (0 = end only)
    overlap: bool = False           # PS: push a shard once backward produced it, pull while the batch loads
    transport: str = "grpc"         # PS: grpc (every byte on gRPC) | tcp (tensors on raw sockets, psgd/ps/tcp.py)
    link: str = ""                  # PS: emulated link BANDWIDTH[,LATENCY] per process, e.g. 1gbit,200us ("" = as is)
    out: str = "results/runs/latest"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)

    @property
    def global_batch(self) -> int:
        """Samples per global step: workers x batch size x accumulated micro-batches."""
        return self.workers * self.batch_size * self.accumulate

    @property
    def budget(self) -> int:
        """Gradients to apply in total (T x N; T global updates in sync)."""
        return self.steps * self.workers


def validate(cfg: RunConfig) -> RunConfig:
    """Raise ValueError with a one-line message naming the flag, else return cfg."""
    checks = [
        (cfg.mode in MODES, f"--mode must be one of {', '.join(MODES)}, got {cfg.mode!r}"),
        (cfg.workers >= 1, f"--workers must be >= 1, got {cfg.workers}"),
        (cfg.servers >= 1, f"--servers must be >= 1, got {cfg.servers}"),
        (cfg.staleness >= 0, f"--staleness must be >= 0, got {cfg.staleness}"),
        (cfg.steps >= 1, f"--steps must be >= 1, got {cfg.steps}"),
        (cfg.epochs >= 0 and math.isfinite(cfg.epochs), f"--epochs must be >= 0, got {cfg.epochs}"),
        (cfg.batch_size >= 1, f"--batch-size must be >= 1, got {cfg.batch_size}"),
        (cfg.accumulate >= 1, f"--accumulate must be >= 1, got {cfg.accumulate}"),
        (cfg.eval_every >= 0, f"--eval-every must be >= 0, got {cfg.eval_every}"),
        (cfg.device in DEVICES, f"--device must be one of {', '.join(DEVICES)}, got {cfg.device!r}"),
        (cfg.wire_dtype in WIRE_DTYPES, f"--wire-dtype must be one of {', '.join(WIRE_DTYPES)}"),
        (cfg.jitter >= 0, f"--jitter must be >= 0 ms, got {cfg.jitter}"),
        (cfg.rpc_timeout > 0, f"--rpc-timeout must be > 0, got {cfg.rpc_timeout}"),
        (cfg.allreduce_impl in ALLREDUCE_IMPLS, f"--allreduce-impl must be one of {', '.join(ALLREDUCE_IMPLS)}"),
        (cfg.bucket_mb > 0 and math.isfinite(cfg.bucket_mb), f"--bucket-mb must be > 0, got {cfg.bucket_mb}"),
        (cfg.backend in BACKENDS, f"--backend must be one of {', '.join(BACKENDS)}, got {cfg.backend!r}"),
        (cfg.check_every >= 0, f"--check-every must be >= 0, got {cfg.check_every}"),
        (_link_error(cfg.link) is None, _link_error(cfg.link) or ""),
        (cfg.transport in TRANSPORTS, f"--transport must be one of {', '.join(TRANSPORTS)}, got {cfg.transport!r}"),
        (cfg.mode != "allreduce" or cfg.transport == "grpc",
         "--transport is a parameter-server option: --mode allreduce talks through torch.distributed"),
        (cfg.mode != "allreduce" or not (cfg.overlap or cfg.link),
         "--overlap and --link are parameter-server options (the worker's gRPC client), not --mode allreduce"),
        (cfg.mode != "allreduce" or cfg.wire_dtype == "fp32",
         "--wire-dtype is a parameter-server option: --mode allreduce reduces fp32 gradients"),
        (all(0 <= r < cfg.workers and ms >= 0 for r, ms in cfg.straggler),
         f"--straggler needs RANK=MS with 0 <= RANK < {cfg.workers} and MS >= 0"),
        (all(0 <= r < cfg.workers and s >= 0 for r, s in cfg.fail_at),
         f"--fail-at needs RANK=STEP with 0 <= RANK < {cfg.workers}"),
        (cfg.data.dataset in DATASETS, f"--dataset must be one of {', '.join(DATASETS)}"),
        (cfg.data.num_samples >= 10, f"--num-samples must be >= 10, got {cfg.data.num_samples}"),
        (cfg.data.shard_data in SHARD_DATA, f"--shard-data must be one of {', '.join(SHARD_DATA)}"),
        (cfg.data.dirichlet_alpha > 0 and math.isfinite(cfg.data.dirichlet_alpha),
         f"--dirichlet-alpha must be > 0, got {cfg.data.dirichlet_alpha}"),
        (0 <= cfg.data.val_fraction < 1, f"--val-fraction must be in [0, 1), got {cfg.data.val_fraction}"),
        (cfg.local_steps >= 1, f"--local-steps must be >= 1, got {cfg.local_steps}"),
        (cfg.local_steps == 1 or cfg.mode in ("sync", "allreduce"),
         "--local-steps is local SGD with synchronous averaging: use it with --mode sync or allreduce"),
        (cfg.local_steps == 1 or cfg.accumulate == 1, "--local-steps and --accumulate exclude each other"),
        (cfg.local_steps == 1 or not cfg.overlap,
         "--overlap streams every step's gradient; with --local-steps there is one exchange per H steps"),
        (cfg.model.model in MODELS, f"--model must be one of {', '.join(MODELS)}"),
        (cfg.model.width >= 0, f"--width must be >= 0, got {cfg.model.width}"),
        (cfg.optim.lr > 0 and math.isfinite(cfg.optim.lr), f"--lr must be > 0, got {cfg.optim.lr}"),
        (0 <= cfg.optim.momentum < 1, f"--momentum must be in [0, 1), got {cfg.optim.momentum}"),
        (cfg.optim.weight_decay >= 0, f"--weight-decay must be >= 0, got {cfg.optim.weight_decay}"),
        (cfg.optim.warmup >= 0, f"--warmup must be >= 0, got {cfg.optim.warmup}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    return cfg


def _link_error(text: str) -> str | None:
    try:
        link.parse(text)
    except ValueError as e:
        return str(e)
    return None


def with_epochs_resolved(cfg: RunConfig, train_size: int) -> RunConfig:
    """Turn --epochs into a step budget now that the training set size is known."""
    if cfg.epochs <= 0:
        return cfg
    steps = max(1, math.ceil(cfg.epochs * train_size / cfg.global_batch))
    return dataclasses.replace(cfg, steps=steps)


def to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(d: dict) -> RunConfig:
    """Inverse of to_dict (reads config.json); unknown keys raise ValueError."""
    d = dict(d)
    nested = {"data": DataConfig, "model": ModelConfig, "optim": OptimConfig}
    kwargs = {}
    for name, klass in nested.items():
        kwargs[name] = klass(**d.pop(name, {}))
    for key in ("straggler", "fail_at"):
        if key in d:
            d[key] = tuple(tuple(p) for p in d[key])
    try:
        return RunConfig(**d, **kwargs)
    except TypeError as e:
        raise ValueError(f"bad config: {e}") from None


def to_argv(cfg: RunConfig) -> list[str]:
    """The flags that rebuild cfg through the CLI (see psgd/cli.py add_run_flags)."""
    argv: list[str] = []
    sections = [cfg, cfg.data, cfg.model, cfg.optim]
    for obj in sections:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, (DataConfig, ModelConfig, OptimConfig)):
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                if value:
                    argv.append(flag)
            elif f.name in ("straggler", "fail_at"):
                for rank, n in value:
                    argv += [flag, f"{rank}={n}"]
            else:
                argv += [flag, str(value)]
    return argv
