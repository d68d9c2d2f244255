"""The config schema's top: `RunConfig`, the run's own fields with the sections nested, and what
follows from it (`updates`, `eval_interval`, `with_epochs_resolved`).

The sections are psgd/core/sections.py, the flag machinery psgd/core/flags.py, the checks
`validate` (psgd/core/config.py, which re-exports everything here). The mode lists are read from
the rules' registry (psgd/core/rules.py `RULES`), so that a check that concerns "every
parameter-server mode" names the list and a new mode is not left out of it. Stdlib only, and
nothing above psgd/core.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

from psgd.core import elastic, rules
from psgd.core.flags import Pairs, opt, parse_servers, shard_count
from psgd.core.sections import DataConfig, ModelConfig, OptimConfig

PS_MODES = tuple(rules.RULES)  # every registered rule (psgd/core/rules.py): the modes are named there once
MODES = PS_MODES + ("allreduce",)
STALE_MODES = tuple(n for n, rule in rules.RULES.items() if rule.on_arrival)  # an update per gradient, maybe stale
LOCAL_SGD_MODES = ("sync", "allreduce", "async")  # --local-steps H > 1 (ssp has no rounds)
WIRE_DTYPES = ("fp32", "fp16", "bf16")
ALLREDUCE_IMPLS = ("library", "ring")
BACKENDS = ("auto", "gloo", "nccl")
JITTER_TAILS = ("exp", "pareto")  # --jitter-tail: the delay's distribution (psgd/train/worker.py)

AUTO = -1            # --eval-every auto, the default (eval_interval)
EVAL_EVERY_MIN = 20  # auto's interval in a short run (the default before the budget counted: issue 33)
EVALS = 15           # auto: about this many intervals in a longer run (each evaluation costs the transformer ~1 s)


@dataclass(frozen=True)
class RunConfig:
    GROUP: ClassVar[str] = "run"
    # The run's own fields in -h, by concern (the rest sit under GROUP): a title, then its fields.
    GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "communication": ("wire_dtype", "topk", "no_error_feedback", "topk_momentum_correction", "topk_warmup_epochs",
                          "rpc_timeout", "separate_pull", "overlap", "transport", "link"),
        "embedding rows (psgd/core/rowconfig.py)": ("embeddings", "row_partition", "row_optimizer"),
        "stale and bad gradients (applied by the shards)": ("staleness_lr", "dc_lambda", "dc_adaptive", "dc_ms_decay",
                                                            "skip_nonfinite"),
        "faults and recovery": ("checkpoint_every", "worker_lease", "fail_at", "fail_shard_at", "restart_workers",
                                "restart_servers"),
        "security": ("tls_cert", "tls_key", "tls_ca", "token_file"),
        "all-reduce": ("allreduce_impl", "bucket_mb", "backend", "check_every"),
        "delays and placement": ("straggler", "jitter", "jitter_tail", "cpu_quota", "hosts", "cluster"),
    }
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
                              "auto: every 20, or every 1/15 of a longer run, so that evaluating costs "
                              "a run at most about 16 evaluations: eval_interval)", metavar="N|auto",
                          parse=lambda text: AUTO if text == "auto" else int(text), shown="auto")
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
    jitter: float = opt(0.0, "every worker sleeps a random delay of this mean per step (--jitter-tail)", metavar="MS")
    jitter_tail: str = opt("exp", "--jitter's distribution: exp (exponential) or pareto (shape 1.5, the same mean, "
                                  "infinite variance: the long tail of a shared cluster's stragglers, as Chen et "
                                  "al. 2016 measured it)", choices=JITTER_TAILS)
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
    fail_at: Pairs = opt((), "fault injection: worker RANK kills itself (SIGKILL) at STEP, or at its first step "
                             "after it (a scheduled joiner's); -1: while starting, before it joins the shards",
                         metavar="RANK=STEP")
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
    transport: str = opt("auto", "PS: what carries pushes and pulls: auto (the fastest that reaches the "
                                 "shards: shared memory where they are on this host, else the raw-socket data plane) "
                                 "or a transport by name, one of psgd/ps/transport.py's TRANSPORTS (grpc, tcp, ...); "
                                 "gRPC always does Init, Info and Leave")
    link: str = opt("", "PS: pace every worker's and shard's traffic to an EMULATED link, e.g. 1gbit,200us or "
                        "100mbit,1ms (psgd/core/link.py; loopback is still what carries the bytes)",
                    metavar="BANDWIDTH[,LATENCY]")
    embeddings: str = opt("dense", "PS: how a model's nn.Embedding tables travel: dense (pulled and pushed whole, "
                                   "as every parameter), rows (the rows a batch touches, by key, under --mode) or "
                                   "hybrid (by key and async, the dense part under --mode: Persia's scheme)",
                          choices=("dense", "rows", "hybrid"))
    row_partition: str = opt("hash", "with --embeddings rows/hybrid: which shard owns a row: hash (scattered) or "
                                     "range (contiguous ids: the hot ones on one shard)", choices=("hash", "range"))
    row_optimizer: str = opt("sgd", "with --embeddings rows/hybrid: the shards' row-wise optimizer, at --lr",
                             choices=("sgd", "adagrad"))
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


def updates(cfg: RunConfig) -> int:
    """Versions a shard (or all-reduce rank 0) reaches in the run: one per step in sync and
    all-reduce, one per gradient in async and SSP, one per averaging round with --local-steps."""
    rounds = max(1, cfg.steps // cfg.local_steps) if cfg.local_steps > 1 else cfg.steps
    return rounds * (cfg.workers if cfg.mode in STALE_MODES else 1)


def eval_interval(cfg: RunConfig) -> int:
    """The snapshot interval the shards and all-reduce rank 0 use: --eval-every N as given, or by
    default (auto) every 20 updates, every updates/15 in a run longer than 300 updates, so that a
    long run is evaluated about 16 times (at 0, every interval, and at the end), not once per 20
    updates (76 times in the transformer's 1,500 steps, about as long as its training took)."""
    if cfg.eval_every != AUTO:
        return cfg.eval_every
    return max(EVAL_EVERY_MIN, math.ceil(updates(cfg) / EVALS))


def with_epochs_resolved(cfg: RunConfig, train_size: int) -> RunConfig:
    """Turn --epochs into a step budget now that the training set size is known."""
    if cfg.epochs <= 0:
        return cfg
    steps = max(1, math.ceil(cfg.epochs * train_size / cfg.global_batch))
    return dataclasses.replace(cfg, steps=steps)
