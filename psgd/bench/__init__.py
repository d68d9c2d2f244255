"""`psgd bench NAME ...`: benchmarks, each in its own module psgd/bench/NAME.py with a main(argv).

Benchmarks report figures measured side by side in one run (ratios against a raw ceiling), never
timing thresholds; tests only check that they run and produce well-formed output.
"""

from __future__ import annotations

import importlib

# name -> one line for `psgd bench -h`; written here, not read from each module's docstring,
# because importing the modules would import torch and gRPC just to print help.
BENCHMARKS = {
    "transport": "psgd's push / pull (gRPC and TCP, K = 1, 2, 4 shards) against a raw TCP socket, same bytes",
    "allreduce": "the library's all-reduce against the hand-written ring, same bytes, busbw as in nccl-tests",
    "scaling": "the bottleneck sweep: real runs over N workers x K shards (and the ring); what sharding buys",
    "calibrate": "fit the cost model's machine and workload numbers on this machine (for psgd model)",
    "peers": "the same training workload through psgd and through PyTorch RPC (and Ray) parameter servers",
    "cluster": "E4 and E10 on kernel-shaped links (psgd cluster, root) beside the Python pacer and the cost model",
    "startup": "a run's start-up forked from the warm parent against exec'd children, beside one torch import",
    "utilisation": "compute utilisation of sync PS, all-reduce, local SGD and DiLoCo per link rate (psgd cluster, "
                   "root), beside the cost model",
    "scale": "8, 16 and 32 worker processes against 2 shards in sync, async, SSP: throughput, waits, staleness, "
             "clock gaps, peak memory per process, start-up, beside the cost model",
    "roundtrip": "the small-model round trip at its ceiling: async N=1 vs the no-server loop, all-reduce vs DDP",
    "transformer": "the GPT with AdamW: psgd PS vs a plain torch loop, psgd all-reduce vs torch DDP; memory",
    "drill": "seeded SIGKILL storms (psgd drill) on sync, async, SSP runs: faults by kind and moment, updates "
             "lost, recovery times, sync's hash against the calm run's",
    "sparse": "dlrm on click logs through row stores (in one process, or --wire: row-server processes): bytes "
              "per step sparse vs dense, per-row vs global staleness, load per shard by hash and range, against "
              "plain torch loops",
    "sim": "what a simulated cluster (psgd run --simulate) costs this machine at N = 1, 64, 1024 async workers "
           "for a fixed number of gradients",
    "sim-vs-real": "real runs beside their simulation (psgd run --simulate, calibrated to each): staleness, "
                   "clock gaps, updates/s, accuracy, and where they differ beyond the tolerance",
}
NAMES = tuple(BENCHMARKS)

# A warm parent (psgd/train/warm.py `Zygote`, psgd/train/launch.py `warm_parent`) for the psgd
# processes the benchmarks start, or None (the default): each benchmark starts them as it always has,
# every shard server a `python -m psgd server` process and every run a `python -m psgd run` process
# (which forks its children from a warm parent of its own). Given one, the shard servers
# (transport.py `shard_servers`) are forked from it, and the `psgd run`s of `roundtrip`,
# `transformer` and `scale` are launched in this process with their children forked from it, as
# `psgd suite` runs its runs. The tests set theirs (tests/warm.py `warm_benches`): one torch import
# for every process a test's benchmark starts; what is measured after start-up is the same.
ZYGOTE = None

HELP = (f"usage: psgd bench {{{','.join(NAMES)}}} [flags]\n\n"
        "Benchmarks that measure figures side by side in one run (ratios against a raw ceiling).\n\n"
        "benchmarks:\n" + "".join(f"  {name:<13}{line}\n" for name, line in BENCHMARKS.items()) +
        "\npsgd bench NAME -h shows each one's flags.")


def main(argv: list[str]) -> int:
    from psgd.core.errors import UsageError

    if not argv:
        raise UsageError(f"name a benchmark: {', '.join(NAMES)} (see psgd bench -h)")
    if argv[0] in ("-h", "--help"):
        print(HELP)
        return 0
    if argv[0] not in NAMES:
        raise UsageError(f"unknown benchmark {argv[0]!r}; choose one of {', '.join(NAMES)}")
    return importlib.import_module(f"psgd.bench.{argv[0].replace('-', '_')}").main(argv[1:])
