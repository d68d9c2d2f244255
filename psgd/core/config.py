"""Run configuration: ONE schema, the frozen dataclasses below, from which everything else is derived.

Contract:
- Each leaf field is declared once, with `opt(default, help, choices=..., metavar=...)`: its name,
  type, default and command-line help. From that one declaration come the flag
  (`batch_size` <-> `--batch-size`, in the help group its section names), the namespace -> config
  step (`from_namespace`), the flags that rebuild a config (`to_argv`), config.json
  (`to_dict` / `from_dict`) and the lab's TOML keys (psgd/lab/experiment.py reads `leaves()`).
  Adding a flag is one field; `validate` gains a line only if the value has a range to check.
- Types are the real annotations (`typing.get_type_hints`): bool (a bare store_true flag), int,
  float, str and `Pairs` (a repeatable `RANK=N` flag). A field's `parse` replaces the type's
  parser on the command line (`--servers` also takes HOST:PORT lists) and `from_arg` turns what it
  parsed into the field's value.
- Leaf names are unique across the nested sections (`data`, `model`, `optim`): flags and TOML
  keys are flat.
- `validate` is the one check at the edge: each failure is a one-line ValueError naming the flag
  (the CLI prints it and exits 2).

`to_argv(cfg)` is how `psgd run` hands the exact same configuration to the server and worker
processes it starts (and how you would start them by hand on other hosts).

Stdlib only, and nothing above psgd/core: every layer imports this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from psgd.core import devices, elastic, link

PS_MODES = ("sync", "async", "ssp")
MODES = PS_MODES + ("allreduce",)
DATASETS = ("synthetic", "mnist1d", "mnist", "text")
MODELS = ("logreg", "mlp", "cnn", "wide_mlp", "gpt")
LOSSES = ("cross_entropy", "mse")
OPTIMIZERS = ("sgd", "adamw")
OUTERS = ("sgd", "nesterov")
WIRE_DTYPES = ("fp32", "fp16", "bf16")
ALLREDUCE_IMPLS = ("library", "ring")
BACKENDS = ("auto", "gloo", "nccl")
TRANSPORTS = ("grpc", "tcp")
SHARD_DATA = ("iid", "noniid", "dirichlet", "dirichlet-equal")

Pairs = tuple[tuple[int, int], ...]   # (rank, n) pairs: a repeatable `--flag RANK=N`, a TOML list ["0=40"]


# -- the field declaration -----------------------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    """What a config field needs besides its type and default to be a command-line flag."""
    help: str
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    aliases: tuple[str, ...] = ()                       # more option strings (`--num-shards`)
    parse: Callable[[str], Any] | None = None           # text -> value, ValueError if bad (default: the type)
    from_arg: Callable[[Any], Any] | None = None        # parsed value -> field value (default: as is)


def opt(default: Any, help: str, *, choices: tuple[str, ...] = (), metavar: str | None = None,
        aliases: tuple[str, ...] = (), parse: Callable[[str], Any] | None = None,
        from_arg: Callable[[Any], Any] | None = None) -> Any:
    """A config field that is also a flag: `lr: float = opt(0.05, "learning rate")`."""
    assert not isinstance(default, (list, dict, set)), "config defaults are immutable (frozen dataclasses)"
    return field(default=default, metadata={"flag": Flag(help, choices, metavar, aliases, parse, from_arg)})


def parse_pair(text: str) -> tuple[int, int]:
    """`RANK=N` -> (rank, n)."""
    try:
        a, b = text.split("=")
        return int(a), int(b)
    except ValueError:
        raise ValueError(f"expected RANK=NUMBER, got {text!r}") from None


def parse_servers(text: str) -> int | list[str]:
    """`--servers 2` (how many shards to start) or `--servers h1:p1,h2:p2` (shards to use)."""
    if text.lstrip("+-").isdigit():
        return int(text)   # a negative count is a count: `validate` says it must be >= 1
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    for a in addresses:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected HOST:PORT[,HOST:PORT...], got {a!r}")
    return addresses


def shard_count(servers: int | list[str]) -> int:
    """The config holds how many shards; `psgd worker` keeps the addresses from the namespace."""
    return servers if isinstance(servers, int) else len(servers)


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
    width: int = opt(0, "hidden width (0: the model's own: mlp 128, wide_mlp 1024, cnn 32 channels, gpt 128)")
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


@dataclass(frozen=True)
class RunConfig:
    GROUP: ClassVar[str] = "run"
    mode: str = opt("sync", "consistency mode (see 'modes' below)", choices=MODES)
    workers: int = opt(2, "number of workers N")
    servers: int = opt(1, "parameter shards K to start (run), or HOST:PORT,... of running shards (worker)",
                       aliases=("--num-shards",), parse=parse_servers, from_arg=shard_count)
    staleness: int = opt(2, "SSP bound s (clock lead allowed)")
    backup_workers: int = opt(0, "sync: apply each update from the first N-b gradients of its step, drop the b late "
                                 "ones (backup workers, Chen et al. 2016)", metavar="B")
    steps: int = opt(100, "budget: run until steps x workers gradients were applied (= steps updates in sync)")
    epochs: float = opt(0.0, "budget in epochs instead of --steps (if > 0)")
    batch_size: int = opt(32, "samples per worker per micro-batch")
    accumulate: int = opt(1, "micro-batches accumulated per push")
    local_steps: int = opt(1, "local SGD: H optimizer steps on each worker's replica between averagings (sync "
                              "PS or allreduce: of all N changes; async PS: each change on arrival, momentum every "
                              "N arrivals, psgd/core/delayed_nesterov.py; 1 = average every step)", metavar="H")
    seed: int = opt(0, "seed of model init and batch order")
    eval_every: int = opt(-1, "snapshot parameters every this many updates, evaluated after the run (0: end only; "
                              "auto, the default: every 20, or every 1/15 of a longer run, so that evaluating costs "
                              "a run at most about 16 evaluations: eval_interval)", metavar="N|auto",
                          parse=lambda text: AUTO if text == "auto" else int(text))
    device: str = opt("auto", "where workers compute: auto (a GPU when there is one), cpu, cuda (worker r takes "
                              "cuda:(LOCAL_RANK or r) % GPUs) or cuda:N (every worker on GPU N; psgd/core/devices.py)",
                      metavar="auto|cpu|cuda|cuda:N")
    threads: int = opt(0, "torch intra-op threads per process; 0: the machine's cores shared by the run's "
                          "processes on it (psgd run: the N workers and K servers), at least 1", metavar="T")
    wire_dtype: str = opt("fp32", "dtype of gradients and parameters on the wire (servers keep fp32)",
                          choices=WIRE_DTYPES)
    topk: float = opt(1.0, "PS: push only this fraction of each shard's gradient, its largest entries by magnitude, "
                           "as indices and values (1: dense pushes); the rest stays on the worker and is added to "
                           "its next gradient (error feedback: Stich et al. 2018, Lin et al. 2018)", metavar="FRACTION")
    no_error_feedback: bool = opt(False, "with --topk < 1: drop what is not sent instead of carrying it over (the "
                                         "control of experiment E13)")
    topk_momentum_correction: bool = opt(False, "with --topk < 1: Deep Gradient Compression's momentum correction "
                                                "(Lin et al. 2018): each worker keeps the velocity (momentum "
                                                "--momentum) and accumulates it, not the gradient, in its residual; "
                                                "the shards then step without momentum")
    topk_warmup_epochs: float = opt(0.0, "with --topk < 1: Deep Gradient Compression's warm-up: in epoch e < E "
                                         "send the fraction max(FRACTION, 0.25^(e+1)) (25%, 6.25%, 1.5625%, ...)",
                                    metavar="E")
    straggler: Pairs = opt((), "worker RANK sleeps MS extra per step (repeatable)", metavar="RANK=MS")
    jitter: float = opt(0.0, "every worker sleeps an exponential random delay of this mean per step", metavar="MS")
    cpu_quota: float = opt(0.0, "give every shard and worker of psgd run this many cores of its own, enforced by the "
                                "kernel (cgroup CPU quota, psgd/train/cpulimit.py): a core one process leaves idle "
                                "(a sleeping straggler) goes unused, as on separate devices (0: the cores are shared)",
                           metavar="CORES")
    skip_nonfinite: bool = opt(False, "servers skip and count non-finite gradients instead of rejecting them")
    # Remedies for stale gradients, applied by the shard (psgd/core/staleness.py): async / SSP only.
    staleness_lr: bool = opt(False, "async / SSP: the shard divides the step of a gradient of staleness tau by "
                                    "max(1, tau) (Zhang et al. 2016, staleness-aware async SGD)")
    dc_lambda: float = opt(0.0, "async / SSP: DC-ASGD (Zheng et al. 2017): the shard adds lambda * g * g * "
                                "(w_now - w_then) to each gradient g, w_then the parameters its worker pulled "
                                "(0: off; the shard keeps up to N pulled copies)", metavar="LAMBDA")
    dc_adaptive: bool = opt(False, "with --dc-lambda: DC-ASGD-a (Zheng et al. 2017): lambda per coordinate "
                                   "--dc-lambda / sqrt(a moving mean square of the gradients)")
    dc_ms_decay: float = opt(0.95, "DC-ASGD-a: the decay m of the mean square, m * MS + (1 - m) * g * g")
    # Long: a pull that SSP or sync holds back waits under this deadline too.
    rpc_timeout: float = opt(60.0, "deadline of every RPC, seconds")
    checkpoint_every: int = opt(0, "PS: each shard writes a checkpoint to OUT/checkpoints every K updates, keeping "
                                   "the last 3 (0: never); `psgd run --resume OUT` continues from them", metavar="K")
    worker_lease: float = opt(0.0, "PS: a worker that sends nothing for this many seconds is lost: the run goes on "
                                    "without it (sync: each later step's update averages the workers left; 0: a "
                                    "worker that dies ends the run)", metavar="SECONDS")
    elastic: str = opt("", "PS: a membership schedule, UPDATE:WORKERS,... (e.g. 0:2,100:4,200:3: two workers, four "
                           "from update 100, three from 200; psgd/core/elastic.py); sets --workers to the slots it "
                           "uses, and --steps counts each worker's steps at the run's start size", metavar="SCHEDULE")
    quorum_lr: bool = opt(False, "sync with --elastic / joins: scale each update with its quorum (the sum of "
                                 "the gradients over the starting --workers, not their mean: SGD's rate follows "
                                 "the effective batch, the linear scaling rule); off: the mean, the rate fixed")
    max_workers: int = opt(0, "PS: worker slots of the shards, for `psgd worker --join` to a running job (0: "
                              "--workers; the run starts with --workers of them)", metavar="M")
    tls_cert: str = opt("", "PS shard: serve both ports over TLS with this certificate (psgd certs makes one)",
                        metavar="PEM")
    tls_key: str = opt("", "PS shard: the private key of --tls-cert", metavar="PEM")
    tls_ca: str = opt("", "PS worker: talk TLS to the shards and trust only certificates signed by this CA",
                      metavar="PEM")
    token_file: str = opt("", "PS: a file holding the run's shared secret; every request to a shard must carry it "
                              "(without it: $PSGD_TOKEN if set, else no token)", metavar="FILE")
    fail_at: Pairs = opt((), "fault injection: worker RANK kills itself (SIGKILL) at STEP (-1: while starting, "
                             "before it joins the shards)", metavar="RANK=STEP")
    fail_shard_at: Pairs = opt((), "fault injection: shard K kills itself (SIGKILL) once it reached update V (0: "
                                   "while starting, before it listens)", metavar="K=V")
    restart_workers: int = opt(0, "PS: restart a worker that dies, at most N times in all; it rejoins at its "
                                  "clock on the shards", metavar="N")
    restart_servers: int = opt(0, "PS: when a shard dies, restart the run from its newest checkpoint, at most N "
                                  "times (needs --checkpoint-every)", metavar="N")
    allreduce_impl: str = opt("library", "allreduce: torch.distributed's all_reduce, or the hand-written ring "
                                         "(psgd/allreduce/ring.py)", choices=ALLREDUCE_IMPLS)
    bucket_mb: float = opt(25.0, "allreduce: gradients are reduced in flat buckets of this many MiB")  # DDP's 25
    backend: str = opt("auto", "allreduce: torch.distributed backend (auto: nccl with one CUDA device per rank, "
                               "else gloo)", choices=BACKENDS)
    check_every: int = opt(50, "allreduce: compare a hash of every replica's parameters every this many updates "
                               "(and at the end; 0: end only)")
    separate_pull: bool = opt(False, "PS: push, then pull in a second round trip (the textbook pattern); by "
                                     "default one PushPull per step answers the push with the next parameters")
    overlap: bool = opt(False, "PS: push each shard's gradient as soon as backward produced it, pull while the "
                               "batch loads and forward runs (psgd/ps/exchange.py)")
    transport: str = opt("tcp", "PS: what carries pushes and pulls: tcp, the shards' raw-socket data plane "
                                "(psgd/ps/tcp_server.py, the faster: psgd bench transport), or grpc (what gRPC "
                                "Python costs); gRPC always does Init, Info and Leave", choices=TRANSPORTS)
    link: str = opt("", "PS: pace every worker's and shard's traffic to an EMULATED link, e.g. 1gbit,200us or "
                        "100mbit,1ms (psgd/core/link.py; loopback is still what carries the bytes)",
                    metavar="BANDWIDTH[,LATENCY]")
    hosts: int = opt(0, "run on H hosts of a `psgd cluster` (network namespaces, links shaped by the kernel): PS "
                        "shard k on host k, the workers on the other hosts; all-reduce worker r on host r mod H "
                        "(psgd/cluster/placement.py). 0: every process on this host's loopback", metavar="H")
    cluster: str = opt("lab", "with --hosts: the cluster's name (psgd cluster up --name)")
    out: str = opt("", "run folder: metrics.jsonl, summary.json, logs/. psgd run: default a new "
                       "results/runs/<mode>-<time> (results/runs/latest links to it); an earlier run's folder "
                       "has psgd's files replaced, any other non-empty folder or a file is refused. server / "
                       "worker by hand: default results/runs/by-hand")
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self) -> None:
        # --elastic: one worker process per slot of the schedule (the launcher starts them all; each
        # trains in its interval only), so --workers is the slot count wherever processes are counted.
        if self.elastic:
            try:
                slots = elastic.capacity(elastic.parse(self.elastic))
            except ValueError:
                return  # validate() says what is wrong with it
            object.__setattr__(self, "workers", slots)

    @property
    def slots(self) -> int:
        """Worker slots of the shards: every worker that may ever be in the run."""
        return max(self.workers, self.max_workers)

    @property
    def members(self) -> int:
        """Workers in the run at update 0 (the schedule's first point with --elastic)."""
        return elastic.parse(self.elastic)[0][1] if self.elastic else self.workers

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
        (0 <= cfg.backup_workers < max(cfg.workers, 1),
         f"--backup-workers must be in 0..N-1 = 0..{cfg.workers - 1} (each update needs at least one of the N "
         f"workers' gradients), got {cfg.backup_workers}"),
        (cfg.backup_workers == 0 or cfg.mode == "sync",
         f"--backup-workers drops the late gradients of a synchronous step: use it with --mode sync (--mode "
         f"{cfg.mode} {'never waits for a step' if cfg.mode != 'allreduce' else 'reduces every gradient'})"),
        (cfg.steps >= 1, f"--steps must be >= 1, got {cfg.steps}"),
        (cfg.epochs >= 0 and math.isfinite(cfg.epochs), f"--epochs must be >= 0, got {cfg.epochs}"),
        (cfg.batch_size >= 1, f"--batch-size must be >= 1, got {cfg.batch_size}"),
        (cfg.accumulate >= 1, f"--accumulate must be >= 1, got {cfg.accumulate}"),
        (cfg.eval_every >= 0 or cfg.eval_every == AUTO, f"--eval-every must be >= 0 or auto, got {cfg.eval_every}"),
        (_error(devices.parse_device, cfg.device) is None, _error(devices.parse_device, cfg.device) or ""),
        (cfg.wire_dtype in WIRE_DTYPES, f"--wire-dtype must be one of {', '.join(WIRE_DTYPES)}"),
        (0 < cfg.topk <= 1, f"--topk must be a fraction in (0, 1] (1: dense pushes), got {cfg.topk}"),
        (cfg.topk == 1 or cfg.mode in PS_MODES,
         "--topk sparsifies parameter-server pushes: --mode allreduce reduces dense gradients"),
        (cfg.topk == 1 or cfg.local_steps == 1,
         "--topk sparsifies gradients, --local-steps pushes model deltas: use one or the other"),
        (not cfg.no_error_feedback or cfg.topk < 1,
         "--no-error-feedback only applies to sparsified pushes: give --topk a fraction below 1"),
        (not (cfg.topk_momentum_correction or cfg.topk_warmup_epochs) or cfg.topk < 1,
         "--topk-momentum-correction and --topk-warmup-epochs only apply to sparsified pushes: give --topk a "
         "fraction below 1"),
        (not cfg.topk_momentum_correction or not cfg.no_error_feedback,
         "--topk-momentum-correction accumulates the velocity in the error-feedback residual: drop "
         "--no-error-feedback"),
        (not cfg.topk_momentum_correction or (cfg.optim.optimizer == "sgd" and not cfg.optim.nesterov),
         "--topk-momentum-correction moves SGD's (non-Nesterov) momentum to the workers: use --optimizer sgd"),
        (cfg.topk_warmup_epochs >= 0 and math.isfinite(cfg.topk_warmup_epochs),
         f"--topk-warmup-epochs must be >= 0, got {cfg.topk_warmup_epochs}"),
        (cfg.jitter >= 0, f"--jitter must be >= 0 ms, got {cfg.jitter}"),
        (cfg.cpu_quota >= 0 and math.isfinite(cfg.cpu_quota), f"--cpu-quota must be >= 0 cores, got {cfg.cpu_quota}"),
        (cfg.rpc_timeout > 0, f"--rpc-timeout must be > 0, got {cfg.rpc_timeout}"),
        (cfg.threads >= 0, f"--threads must be >= 0 (0: share the cores), got {cfg.threads}"),
        (cfg.allreduce_impl in ALLREDUCE_IMPLS, f"--allreduce-impl must be one of {', '.join(ALLREDUCE_IMPLS)}"),
        (cfg.bucket_mb > 0 and math.isfinite(cfg.bucket_mb), f"--bucket-mb must be > 0, got {cfg.bucket_mb}"),
        (cfg.backend in BACKENDS, f"--backend must be one of {', '.join(BACKENDS)}, got {cfg.backend!r}"),
        (cfg.check_every >= 0, f"--check-every must be >= 0, got {cfg.check_every}"),
        (_error(link.parse, cfg.link) is None, _error(link.parse, cfg.link) or ""),
        (cfg.hosts >= 0, f"--hosts must be >= 0 (0: this host's loopback), got {cfg.hosts}"),
        (cfg.hosts == 0 or not cfg.link,
         "--link paces loopback; on a cluster (--hosts) its own links shape the run: give the link to "
         "`psgd cluster up --link` instead"),
        (cfg.transport in TRANSPORTS, f"--transport must be one of {', '.join(TRANSPORTS)}, got {cfg.transport!r}"),
        # servers=1 is the default, so only a count asked for explicitly contradicts the mode.
        (cfg.mode != "allreduce" or cfg.servers == 1,
         f"--servers is a parameter-server option: --mode allreduce has no servers (got --servers {cfg.servers})"),
        (cfg.mode != "allreduce" or cfg.transport == RunConfig.transport,
         "--transport is a parameter-server option: --mode allreduce talks through torch.distributed"),
        (cfg.mode != "allreduce" or not cfg.separate_pull,
         "--separate-pull is a parameter-server option: --mode allreduce has no pulls"),
        (cfg.mode != "allreduce" or not (cfg.overlap or cfg.link),
         "--overlap and --link are parameter-server options (the worker's gRPC client), not --mode allreduce"),
        (cfg.mode != "allreduce" or cfg.wire_dtype == "fp32",
         "--wire-dtype is a parameter-server option: --mode allreduce reduces fp32 gradients"),
        (all(0 <= r < cfg.workers and ms >= 0 for r, ms in cfg.straggler),
         f"--straggler needs RANK=MS with 0 <= RANK < {cfg.workers} and MS >= 0"),
        (all(0 <= r < cfg.workers and s >= -1 for r, s in cfg.fail_at),
         f"--fail-at needs RANK=STEP with 0 <= RANK < {cfg.workers} and STEP >= -1"),
        (all(0 <= k < cfg.servers and v >= 0 for k, v in cfg.fail_shard_at) and
         (cfg.mode != "allreduce" or not cfg.fail_shard_at),
         f"--fail-shard-at needs K=V with 0 <= K < {cfg.servers} and V >= 0 (parameter-server modes)"),
        (cfg.restart_servers >= 0, f"--restart-servers must be >= 0, got {cfg.restart_servers}"),
        (cfg.restart_workers >= 0, f"--restart-workers must be >= 0, got {cfg.restart_workers}"),
        (cfg.restart_workers == 0 or (cfg.mode != "allreduce" and cfg.local_steps == 1),
         "--restart-workers: a parameter-server run without --local-steps (the shards keep each worker's clock; "
         "an all-reduce group cannot take a new rank in)"),
        (cfg.restart_servers == 0 or cfg.checkpoint_every > 0,
         "--restart-servers restarts from checkpoints: give --checkpoint-every K too"),
        (cfg.restart_servers == 0 or cfg.mode == "sync" or cfg.servers == 1,
         "--restart-servers: an async or SSP run restarts with one shard only (its shards' clocks differ)"),
        (cfg.restart_servers == 0 or cfg.local_steps == 1, "--restart-servers does not work with --local-steps"),
        (cfg.data.dataset in DATASETS or is_spec(cfg.data.dataset),
         f"--dataset must be one of {', '.join(DATASETS)} or MODULE:FUNCTION / FILE.py:FUNCTION, got "
         f"{cfg.data.dataset!r}"),
        (cfg.data.num_samples >= 10, f"--num-samples must be >= 10, got {cfg.data.num_samples}"),
        (cfg.data.shard_data in SHARD_DATA, f"--shard-data must be one of {', '.join(SHARD_DATA)}"),
        (cfg.data.dirichlet_alpha > 0 and math.isfinite(cfg.data.dirichlet_alpha),
         f"--dirichlet-alpha must be > 0, got {cfg.data.dirichlet_alpha}"),
        (0 <= cfg.data.val_fraction < 1, f"--val-fraction must be in [0, 1), got {cfg.data.val_fraction}"),
        (cfg.local_steps >= 1, f"--local-steps must be >= 1, got {cfg.local_steps}"),
        (cfg.local_steps == 1 or cfg.mode in ("sync", "allreduce", "async"),
         "--local-steps is local SGD: use it with --mode sync, allreduce or async (ssp has no rounds)"),
        (bool(cfg.tls_cert) == bool(cfg.tls_key), "--tls-cert and --tls-key go together (a certificate and its key)"),
        (cfg.checkpoint_every >= 0, f"--checkpoint-every must be >= 0, got {cfg.checkpoint_every}"),
        (cfg.mode != "allreduce" or cfg.checkpoint_every == 0,
         "--checkpoint-every is a parameter-server option: the shards write the checkpoints"),
        (cfg.worker_lease >= 0 and math.isfinite(cfg.worker_lease),
         f"--worker-lease must be seconds >= 0, got {cfg.worker_lease}"),
        (cfg.worker_lease == 0 or cfg.mode != "allreduce",
         "--worker-lease is a parameter-server option: an all-reduce group cannot go on without a rank"),
        (cfg.worker_lease == 0 or cfg.mode != "sync" or (cfg.backup_workers == 0 and cfg.restart_workers == 0),
         "--worker-lease in sync shrinks each step's quorum when a worker is lost; --backup-workers and "
         "--restart-workers are the other answers to a slow or dead worker: use one of them"),
        (cfg.worker_lease == 0 or cfg.mode != "sync" or cfg.checkpoint_every == 0,
         "--worker-lease in sync with --checkpoint-every: a checkpoint does not keep the shrunk quorum yet, so a "
         "resumed run would wait for the lost worker; use one or the other"),
        (not cfg.elastic or _error(elastic.parse, cfg.elastic) is None, _error(elastic.parse, cfg.elastic or "0:1")),
        (cfg.max_workers >= 0, f"--max-workers must be >= 0, got {cfg.max_workers}"),
        (not (cfg.elastic or cfg.max_workers > cfg.workers) or cfg.mode in ("sync", "async", "ssp"),
         "--elastic and --max-workers change a parameter-server job's workers: an all-reduce group is fixed"),
        (not (cfg.elastic or cfg.max_workers > cfg.workers) or (cfg.backup_workers == 0 and cfg.local_steps == 1),
         "--elastic and --max-workers: not with --backup-workers (a fixed quorum) or --local-steps (rounds, not "
         "steps)"),
        (not (cfg.elastic and cfg.max_workers), "--elastic sets the slots itself: leave out --max-workers"),
        (not cfg.quorum_lr or cfg.mode == "sync", "--quorum-lr scales a synchronous step with its quorum: use it "
                                                  "with --mode sync"),
        (not cfg.elastic or cfg.restart_workers == 0,
         "--elastic with --restart-workers: a scheduled worker that dies is not restarted; use --worker-lease"),
        (cfg.checkpoint_every == 0 or cfg.backup_workers == 0 or cfg.servers == 1,
         "--checkpoint-every with --backup-workers needs one shard: each shard takes its own first N-b "
         "gradients, so their checkpoints of one version disagree on the workers' clocks"),
        (cfg.local_steps == 1 or cfg.accumulate == 1, "--local-steps and --accumulate exclude each other"),
        (cfg.local_steps == 1 or not (cfg.staleness_lr or cfg.dc_lambda),
         "--staleness-lr and --dc-lambda correct stale gradients; with --local-steps a push is a parameter change"),
        (cfg.dc_lambda >= 0 and math.isfinite(cfg.dc_lambda), f"--dc-lambda must be >= 0, got {cfg.dc_lambda}"),
        (not cfg.dc_adaptive or cfg.dc_lambda > 0, "--dc-adaptive scales --dc-lambda: give --dc-lambda > 0"),
        (0 <= cfg.dc_ms_decay < 1, f"--dc-ms-decay must be in [0, 1), got {cfg.dc_ms_decay}"),
        (cfg.mode in ("async", "ssp") or not (cfg.staleness_lr or cfg.dc_lambda),
         f"--staleness-lr and --dc-lambda correct stale gradients: use them with --mode async or ssp "
         f"(--mode {cfg.mode} has no stale gradients)"),
        (cfg.local_steps == 1 or not cfg.overlap,
         "--overlap streams every step's gradient; with --local-steps there is one exchange per H steps"),
        (cfg.model.model in MODELS or is_spec(cfg.model.model),
         f"--model must be one of {', '.join(MODELS)} or MODULE:FUNCTION / FILE.py:FUNCTION, got {cfg.model.model!r}"),
        (cfg.model.loss in LOSSES or is_spec(cfg.model.loss),
         f"--loss must be one of {', '.join(LOSSES)} or MODULE:FUNCTION / FILE.py:FUNCTION, got {cfg.model.loss!r}"),
        (cfg.optim.optimizer in OPTIMIZERS, f"--optimizer must be one of {', '.join(OPTIMIZERS)}"),
        (0 <= cfg.optim.beta1 < 1 and 0 <= cfg.optim.beta2 < 1,
         f"--beta1 and --beta2 must be in [0, 1), got {cfg.optim.beta1} and {cfg.optim.beta2}"),
        (cfg.optim.eps > 0 and math.isfinite(cfg.optim.eps), f"--eps must be > 0, got {cfg.optim.eps}"),
        (cfg.optim.outer in OUTERS, f"--outer must be one of {', '.join(OUTERS)}"),
        (cfg.optim.outer_lr >= 0 and math.isfinite(cfg.optim.outer_lr),
         f"--outer-lr must be >= 0, got {cfg.optim.outer_lr}"),
        (0 <= cfg.optim.outer_momentum < 1, f"--outer-momentum must be in [0, 1), got {cfg.optim.outer_momentum}"),
        (cfg.local_steps > 1 or (cfg.optim.outer == "sgd" and not cfg.optim.outer_lr and not cfg.optim.outer_momentum),
         "--outer, --outer-lr and --outer-momentum set local SGD's outer step: give --local-steps H > 1"),
        (not cfg.optim.nesterov or (cfg.optim.optimizer == "sgd" and cfg.optim.momentum > 0),
         "--nesterov is SGD's Nesterov momentum: it needs --optimizer sgd and --momentum > 0"),
        (cfg.model.width >= 0, f"--width must be >= 0, got {cfg.model.width}"),
        (cfg.model.layers >= 1 and cfg.model.heads >= 1 and (cfg.model.width or 128) % cfg.model.heads == 0,
         f"--layers and --heads must be >= 1 and --heads must divide --width (gpt: {cfg.model.width or 128}), got "
         f"--layers {cfg.model.layers} --heads {cfg.model.heads}"),
        (cfg.optim.lr > 0 and math.isfinite(cfg.optim.lr), f"--lr must be > 0, got {cfg.optim.lr}"),
        (0 <= cfg.optim.momentum < 1, f"--momentum must be in [0, 1), got {cfg.optim.momentum}"),
        (cfg.optim.weight_decay >= 0, f"--weight-decay must be >= 0, got {cfg.optim.weight_decay}"),
        (cfg.optim.warmup >= 0, f"--warmup must be >= 0, got {cfg.optim.warmup}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    return cfg


def is_spec(name: str) -> bool:
    """A user's callable by import path (`pkg.mod:fn`, `path/file.py:fn`) rather than a built-in name."""
    left, sep, attr = name.rpartition(":")
    return bool(sep and left and attr)


def _error(parse: Callable[[str], Any], text: str) -> str | None:
    """parse(text)'s ValueError message, or None when it parses."""
    try:
        parse(text)
    except ValueError as e:
        return str(e)
    return None


AUTO = -1            # --eval-every auto, the default (eval_interval)
EVAL_EVERY_MIN = 20  # auto's interval in a short run (the default before the budget counted: issue 33)
EVALS = 15           # auto: about this many intervals in a longer run (each evaluation costs the transformer ~1 s)


def updates(cfg: RunConfig) -> int:
    """Versions a shard (or all-reduce rank 0) reaches in the run: one per step in sync and
    all-reduce, one per gradient in async and SSP, one per averaging round with --local-steps."""
    rounds = max(1, cfg.steps // cfg.local_steps) if cfg.local_steps > 1 else cfg.steps
    return rounds * (cfg.workers if cfg.mode in ("async", "ssp") else 1)


def eval_interval(cfg: RunConfig) -> int:
    """The snapshot interval the shards and all-reduce rank 0 use: --eval-every N as given, or by
    default (auto) every 20 updates, every updates/15 in a run longer than 300 updates, so that a
    long run is evaluated about 16 times (at 0, every interval, and at the end), not once per 20
    updates (the transformer's 1,500 steps: 76 evaluations, a minute and a half after 88 s of training)."""
    if cfg.eval_every != AUTO:
        return cfg.eval_every
    return max(EVAL_EVERY_MIN, math.ceil(updates(cfg) / EVALS))


def with_epochs_resolved(cfg: RunConfig, train_size: int) -> RunConfig:
    """Turn --epochs into a step budget now that the training set size is known."""
    if cfg.epochs <= 0:
        return cfg
    steps = max(1, math.ceil(cfg.epochs * train_size / cfg.global_batch))
    return dataclasses.replace(cfg, steps=steps)


# -- derived from the schema -------------------------------------------------------------------------
@dataclass(frozen=True)
class Leaf:
    """One flag-bearing field of a schema, with where it sits."""
    section: str          # "" for the schema's own fields, else the nested section's field name ("data")
    name: str             # the flag (--name-with-dashes), the TOML key, the namespace attribute
    type: Any             # the resolved annotation: bool, int, float, str or Pairs
    default: Any
    flag: Flag
    group: str            # help group title: the section class's GROUP


@functools.cache
def leaves(schema: type = RunConfig) -> tuple[Leaf, ...]:
    """The schema's flag-bearing fields in declaration order, the nested sections' fields in place."""
    out = []
    for f, typ in _fields(schema):
        if dataclasses.is_dataclass(typ):
            out += [Leaf(f.name, f2.name, t2, _default(f2), _flag(typ, f2), typ.GROUP) for f2, t2 in _fields(typ)]
        else:
            out.append(Leaf("", f.name, typ, _default(f), _flag(schema, f), schema.GROUP))
    names = [leaf.name for leaf in out]
    assert len(set(names)) == len(names), f"{schema.__name__}: field names repeat across sections: {names}"
    for leaf in out:
        assert leaf.type in (bool, int, float, str, Pairs), f"{leaf.name}: no flag for type {leaf.type}"
        assert leaf.type is not bool or leaf.default is False, f"{leaf.name}: a bool flag is off by default"
    return tuple(out)


def _fields(klass: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(klass)  # the real types, not the strings `from __future__` leaves
    return [(f, hints[f.name]) for f in dataclasses.fields(klass)]


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def _flag(klass: type, f: dataclasses.Field) -> Flag:
    flag = f.metadata.get("flag")
    assert isinstance(flag, Flag) and flag.help, f"{klass.__name__}.{f.name}: declare it with opt(default, help)"
    return flag


def add_flags(parser: argparse.ArgumentParser, schema: type = RunConfig) -> None:
    """Add one flag per leaf of the schema, in its section's help group."""
    groups: dict[str, Any] = {}
    for leaf in leaves(schema):
        if leaf.group not in groups:
            groups[leaf.group] = parser.add_argument_group(leaf.group)
        flag = leaf.flag
        kw: dict[str, Any] = {"dest": leaf.name, "help": (flag.help + _default_note(leaf)).replace("%", "%%")}
        if flag.metavar:
            kw["metavar"] = flag.metavar
        if flag.choices:
            kw["choices"] = flag.choices
        parse = _for_argparse(flag.parse) if flag.parse else None
        if leaf.type is bool:
            kw["action"] = "store_true"
        elif leaf.type == Pairs:
            kw.update(type=parse or _for_argparse(parse_pair), action="append", default=list(leaf.default))
        else:
            kw.update(default=leaf.default)
            if parse or leaf.type is not str:
                kw["type"] = parse or leaf.type
        groups[leaf.group].add_argument("--" + leaf.name.replace("_", "-"), *flag.aliases, **kw)


def _default_note(leaf: Leaf) -> str:
    """' (default: X)' for the help, so that `-h` tells what a run does when the flag is left out.

    None for a bool (off unless given) and for an empty string or list: there is nothing to show,
    and the help says what leaving it out means. Derived here, not written into each help, so that
    the printed default cannot disagree with the real one.
    """
    if leaf.type is bool or leaf.default in ("", ()):
        return ""
    return f" (default: {leaf.default})"


def _for_argparse(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse prints an ArgumentTypeError's message as is (a ValueError becomes 'invalid value')."""
    def wrapped(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return wrapped


def from_namespace(ns: argparse.Namespace, schema: type = RunConfig) -> Any:
    """Parsed flags -> config (not validated: see `validate`)."""
    flat = {}
    for leaf in leaves(schema):
        value = getattr(ns, leaf.name)
        flat[leaf.name] = leaf.flag.from_arg(value) if leaf.flag.from_arg else value
    return from_flat(flat, schema)


def from_flat(flat: dict, schema: type = RunConfig) -> Any:
    """Flat leaf names (flags, TOML keys) -> config, the missing ones at their defaults (not validated)."""
    by_name = {leaf.name: leaf for leaf in leaves(schema)}
    unknown = [k for k in flat if k not in by_name]
    if unknown:
        raise ValueError(f"bad config: unknown key {unknown[0]!r}")
    values = {k: tuple(tuple(p) for p in v) if by_name[k].type == Pairs else v for k, v in flat.items()}
    nested: dict[str, dict] = {}
    for k, v in values.items():
        nested.setdefault(by_name[k].section, {})[k] = v
    top = nested.pop("", {})
    sections = {f.name: typ(**nested.get(f.name, {})) for f, typ in _fields(schema) if dataclasses.is_dataclass(typ)}
    return schema(**top, **sections)


def to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(d: dict, schema: type = RunConfig) -> Any:
    """Inverse of to_dict (reads config.json): nested sections; unknown keys raise ValueError ("sources",
    the record of the user's files that config.json may hold, is skipped)."""
    where = {leaf.name: leaf.section for leaf in leaves(schema)}
    flat = {}
    for key, value in d.items():
        if key == "sources":  # config.json's record of the user's files (psgd/train/workload.py): not a setting
            continue
        section = key if key in where.values() and key and isinstance(value, dict) else ""
        for k, v in (value.items() if section else [(key, value)]):
            if where.get(k) != section:
                raise ValueError(f"bad config: unknown key {f'{section}.{k}' if section else k!r}")
            flat[k] = v
    try:
        return from_flat(flat, schema)
    except TypeError as e:
        raise ValueError(f"bad config: {e}") from None


def to_argv(cfg: Any) -> list[str]:
    """The flags that rebuild cfg through `add_flags` (and so through `psgd run | server | worker`)."""
    argv: list[str] = []
    for leaf in leaves(type(cfg)):
        value = getattr(getattr(cfg, leaf.section) if leaf.section else cfg, leaf.name)
        flag = "--" + leaf.name.replace("_", "-")
        if leaf.type is bool:
            argv += [flag] if value else []
        elif leaf.type == Pairs:
            for rank, n in value:
                argv += [flag, f"{rank}={n}"]
        else:
            argv += [flag, str(value)]
    return argv
