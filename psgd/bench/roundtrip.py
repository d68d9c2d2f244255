"""`psgd bench roundtrip`: psgd's small-model round trip against its ceiling, side by side, interleaved.

Contract: for each workload in `--workloads` (`mlp256` and `mlp2048`: the MLP 40 -> W -> W -> 10 on
MNIST-1D, batch 32, plain SGD lr 0.05, one torch thread per process; `gpt`: the small transformer
with AdamW, as `psgd bench transformer`; `dlrm[-medium|-large][-rows]`: the sparse suite's recommender
on clicks, its tables whole or by row, batch 32, plain SGD: `dlrm_workload`) and each of `--rounds`
rounds, six arms run one after the other, in an order rotated per round (so no arm always runs first
on a warm or a loaded machine):
- `plain`: the ceiling of a parameter server with one worker: one process computes the gradient
  and steps torch's own optimizer itself, on psgd's batches and model (psgd/bench/arms.py
  `torch_loop`);
- `floor`: the least a server in a second process costs: the same loop with the update in a
  forked server that keeps its own parameters, gradients and parameters shared without a copy on
  the worker's side, two blocking wake-ups per step and nothing else (psgd/bench/floor.py);
- `floor-spin` (not in the default arms): the floor with both processes spinning on a counter in
  shared memory instead of sleeping: the floor's price without its wake-ups, a core held busy;
- `plain-sparse` (not in the default arms; for the dlrm workloads): `plain` with the tables' gradients
  sparse (`nn.Embedding(sparse=True)`, which torch's SGD steps by row): the tighter ceiling of a row path;
- `floor-rows` (not in the default arms; for the dlrm workloads): the floor of a row path, the tables
  on the forked server, each step's distinct rows and their summed gradients riding the floor's one
  round trip, one dedup, gather and index_add_ a step (psgd/bench/rowfloor.py);
- `ps`: `psgd run --mode async --workers 1 --servers 1` on its default transport (`auto`, which takes
  shm on one host: psgd/ps/transport.py `choose`), every gradient and parameter through the shard;
- `shm`: the same with `--transport shm` named (the frames on the socket, the payloads in shared memory);
- `ddp`: torch DDP on gloo, 2 ranks (the ceiling of an all-reduce);
- `allreduce`: `psgd run --mode allreduce --workers 2`.
Each arm's samples/s at its median step, steady state (the first `--skip` steps and the last one
left out; the same clock, step-end times, for every arm: arms.py `steady_rate`). The table
gives, per workload, each round's ratios and their median: ps / plain, shm / plain (psgd against
the ceiling), floor / plain (the price of a second process, which no server design avoids),
shm / floor (psgd's own overhead above that floor), allreduce / ddp, ps and shm over
plain-sparse, floor-rows / plain and ps / floor-rows where those arms ran. Writes
OUT/roundtrip.csv (one row per run), OUT/roundtrip.md and OUT/command.txt; the runs under `--runs`.

    psgd bench roundtrip                                  # 3 rounds x 3 workloads x 6 arms
    psgd bench roundtrip --workloads mlp256 --rounds 1 --steps 40
    psgd bench roundtrip --workloads dlrm,dlrm-rows --arms plain,plain-sparse,ps,shm --steps 400
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

from psgd.bench import record
from psgd.bench import transformer as tb
from psgd.core.config import DataConfig, ModelConfig, OptimConfig, RunConfig

ARMS = ("plain", "floor", "ps", "shm", "ddp", "allreduce")
OTHER_ARMS = ("floor-spin", "plain-sparse", "floor-rows")  # run when named in --arms (the last two: dlrm only)
# (an arm, what it is measured against): psgd against the ceiling, the floor against the ceiling,
# psgd against the floor, and the all-reduce against DDP.
PAIRS = (("ps", "plain"), ("shm", "plain"), ("floor", "plain"), ("shm", "floor"), ("floor-spin", "plain"),
         ("ps", "plain-sparse"), ("shm", "plain-sparse"), ("floor-rows", "plain"), ("ps", "floor-rows"),
         ("allreduce", "ddp"))
FIELDS = ("workload", "round", "arm", "samples_per_s", "step_ms", "steps_timed", "compute_ms", "exchange_ms")


def workload(name: str, steps: int) -> RunConfig:
    if name == "gpt":
        return tb.workload(steps=steps, threads=1)
    if name.startswith("dlrm"):
        return dlrm_workload(name, steps)
    if not name.startswith("mlp") or not name[3:].isdigit():
        raise ValueError(f"unknown workload {name!r}: mlpW (e.g. mlp256), gpt or dlrm[-medium|-large][-rows]")
    return _small(steps, data=DataConfig(dataset="mnist1d"), model=ModelConfig(model="mlp", width=int(name[3:])))


def default_steps(name: str) -> int:
    """Steps per run when --steps is not given: fewer for the workloads whose step is long."""
    return 100 if name in ("gpt", "mlp2048") or "-large" in name else 300


def _small(steps: int, **kw) -> RunConfig:
    """A small model's run: batch 32, plain SGD lr 0.05 without momentum, one torch thread, no evaluation."""
    return RunConfig(steps=steps, batch_size=32, threads=1, eval_every=0, device="cpu", rpc_timeout=600.0,
                     optim=OptimConfig(optimizer="sgd", lr=0.05, momentum=0.0), **kw)


def dlrm_workload(name: str, steps: int) -> RunConfig:
    """The sparse suite's recommender (issue 56's "async N=1 on dlrm" against the plain loop): `dlrm`
    on `--dataset clicks`, `-medium` / `-large` on clicks-medium / clicks-large (about 10^6 ids), its
    tables pulled and pushed whole (psgd run's default, --embeddings dense) or, with `-rows`, served by
    row (--embeddings rows, as experiments/sparse.toml runs it). Batch 32, plain SGD, as the MLPs."""
    rest = name[len("dlrm"):]
    rows = rest.endswith("-rows")
    size = rest[:-len("-rows")] if rows else rest
    if size not in ("", "-medium", "-large"):
        raise ValueError(f"unknown workload {name!r}: dlrm[-medium|-large][-rows]")
    return _small(steps, data=DataConfig(dataset="clicks" + size), model=ModelConfig(model="dlrm"),
                  embeddings="rows" if rows else "dense")


def ratios(rows: list[dict], name: str) -> dict[str, list[float]]:
    """Per round of `name`, each pair's ratio (psgd's samples/s over its ceiling's)."""
    out: dict[str, list[float]] = {}
    for mine, ceiling in PAIRS:
        for r in sorted({x["round"] for x in rows if x["workload"] == name}):
            got = {x["arm"]: x["samples_per_s"] for x in rows if x["workload"] == name and x["round"] == r}
            if got.get(mine) and got.get(ceiling):
                out.setdefault(f"{mine} / {ceiling}", []).append(got[mine] / got[ceiling])
    return out


def table(rows: list[dict], names: list[str]) -> str:
    lines = ["| workload | ratio | per round | median |", "|---|---|---|---|"]
    for name in names:
        for pair, values in ratios(rows, name).items():
            lines.append(f"| {name} | {pair} | {', '.join(f'{v:.2f}x' for v in values)} | "
                         f"**{statistics.median(values):.2f}x** |")
    lines.append("\nsamples/s at each arm's median step, steady state; the arms of a round run one after the "
                 "other, in an order rotated per round.")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    from psgd.core.errors import Parser, UsageError

    p = Parser(prog="psgd bench roundtrip", description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="mlp256,mlp2048,gpt", help="mlpW (the MLP of width W), gpt or "
                   "dlrm[-medium|-large][-rows] (the recommender, its tables whole or by row)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the table shows each and the median)")
    p.add_argument("--steps", default="", help="steps per run, one per workload (or one for all; default: 100 "
                   "for gpt, mlp2048 and the -large recommenders, 300 for the others)")
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the timing")
    p.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS + OTHER_ARMS)}")
    p.add_argument("--out", default=record.scratch("bench/roundtrip"), help="folder for the table, CSV and "
                   "command (default: %(default)s, git-ignored)")
    p.add_argument("--runs", default="results/runs/roundtrip", help="folder for the runs themselves")
    a = p.parse_args(argv)
    names = [w.strip() for w in a.workloads.split(",") if w.strip()]
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    try:
        steps = [int(s) for s in a.steps.split(",")] if a.steps else [default_steps(n) for n in names]
        steps = steps * len(names) if len(steps) == 1 else steps
        if len(steps) != len(names):
            raise ValueError(f"{len(steps)} step counts for {len(names)} workloads: give one per workload, or one")
        bases = {n: workload(n, s) for n, s in zip(names, steps, strict=True)}
    except ValueError as e:
        raise UsageError(f"--workloads / --steps: {e}") from None
    if a.rounds < 1 or not set(arms) <= set(ARMS + OTHER_ARMS) or not arms:
        raise UsageError(f"--rounds must be >= 1 and --arms of {', '.join(ARMS + OTHER_ARMS)}")
    for arm, what in (("plain-sparse", "the ceiling"), ("floor-rows", "the floor")):
        if arm in arms and not all(n.startswith("dlrm") for n in names):
            raise UsageError(f"--arms {arm}: only with the dlrm workloads ({what} of a row path)")
    out, runs = Path(a.out), Path(a.runs).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for r in range(a.rounds):
        for name in names:
            order = arms[r % len(arms):] + arms[:r % len(arms)]
            for arm in order:
                cfg = tb.arm_config(bases[name], arm, runs / f"{name}-{arm}-{r}")
                got = tb.run_arm(arm, cfg, a.skip)
                rows.append({"workload": name, "round": r, "arm": arm, **{k: got.get(k) for k in FIELDS[3:]}})
                print(f"round {r} {name} {arm}: {got['samples_per_s']:,.0f} samples/s", flush=True)
    with open(out / "roundtrip.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    text = table(rows, names)
    (out / "roundtrip.md").write_text(text)
    (out / "command.txt").write_text("psgd bench roundtrip " + " ".join(argv) + "\n")
    print(text)
    return 0
