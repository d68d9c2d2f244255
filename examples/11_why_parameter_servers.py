"""11 - why parameter servers still exist: a recommender model's embedding tables, moved by row.

What it shows: steps 05-06 showed all-reduce replacing the parameter server for a dense model; this
is the case where it does not. DLRM (psgd/train/dlrm.py) on synthetic click logs
(psgd/train/clicks.py) keeps most of its parameters in embedding tables, and a batch reads a few
hundred of their rows. All-reduce must reduce every table's whole gradient each step (what DDP
does for nn.Embedding without sparse collectives); a parameter server that owns the tables by row
(psgd/core/rows.py) moves only the rows a batch touches. Three numbers, in one process, with the
row stores and the worker's sparse side that `psgd run --embeddings rows` runs (psgd/bench/sparse.py):
- bytes per worker step, all-reduce against the PS by row, on DLRM and on the dense MLP of step 05;
- staleness, 4 async workers in turn: the shard's (global: N-1 updates between a pull and its push)
  and each row's own (updates that row took in between: a row changes only when a push names it).
  That gap is why async costs a sparse model less (the first seed article: async is "seen mostly
  in recommender systems and other sparse settings"; measured as E24, make experiments-sparse);
- hot keys: rows per shard under range partitioning (the hot ids together) and hash.

    python examples/11_why_parameter_servers.py
    psgd run --dataset clicks --model dlrm --embeddings rows --mode async --servers 2   # the real thing

Everything printed is accounting or a deterministic replay (workers in turn): no timing.
"""

from __future__ import annotations

from psgd.bench import sparse
from psgd.core.config import DataConfig, ModelConfig
from psgd.train import data, models

N = 4


def allreduce_bytes(params: int) -> float:
    """Per worker and step, a ring all-reduce of `params` fp32 values: 2 (N - 1) / N of them, sent."""
    return 2 * (N - 1) / N * 4 * params


def bytes_table() -> tuple[float, float]:
    args = sparse.parser().parse_args(["--dataset", "clicks-medium", "--steps", "20"])
    ds = data.load(DataConfig(dataset="clicks-medium", num_samples=4000))
    b = sparse.bytes_row(args, ds)
    mlp = models.count(ModelConfig(model="mlp"), *data.SHAPES["mnist1d"])
    ps_sparse = 2 * b["dense_part_bytes_per_step"] + b["sparse_pull_bytes_per_step"] + b["sparse_push_bytes_per_step"]
    print(f"bytes per worker step, N={N} (KB; the PS server's link carries N times a worker's)")
    print(f"  MLP  {mlp:>9,} params        all-reduce {allreduce_bytes(mlp) / 1e3:8.1f}   "
          f"PS {2 * 4 * mlp / 1e3:8.1f}")
    print(f"  DLRM {b['params']:>9,} params        all-reduce {allreduce_bytes(b['params']) / 1e3:8.1f}   "
          f"PS by row {ps_sparse / 1e3:8.1f}   ({b['table_params']:,} in tables; "
          f"{b['touched_rows_per_step']:.0f} rows touched a step)")
    return allreduce_bytes(b["params"]), ps_sparse


def main() -> None:
    ring, by_row = bytes_table()
    args = sparse.parser().parse_args(["--steps", "40"])
    ds = data.load(DataConfig(dataset="clicks", num_samples=4000))
    s = sparse.staleness_row(args, ds, N)
    print(f"staleness, {N} async workers in turn: global {s['global_mean']:.1f}, per row {s['row_mean']:.2f} "
          f"(max {s['row_max']}, {s['row_zero_share']:.0%} of row gradients fresh)")
    load = sparse.load_row(args, ds)
    for scheme in ("range", "hash"):
        print(f"lookups per shard, {scheme:5s}: {' / '.join(f'{v:,}' for v in load[scheme]['lookups'])}"
              f"   busiest / mean {load[scheme]['max_over_mean']:.2f}")
    assert by_row < ring / 10, "the PS by row moves a fraction of what all-reduce must"
    assert s["row_mean"] < s["global_mean"], "a row's own staleness is below the shard's"
    assert load["range"]["max_over_mean"] > load["hash"]["max_over_mean"], "range puts the hot ids on one shard"
    print("checked: by row the PS moves under a tenth of all-reduce's bytes; rows are less stale than the shard; "
          "range loads one shard more than hash")


if __name__ == "__main__":
    main()
