"""`psgd bench drill`: longer fault storms (psgd/train/drill.py) against sync, async and SSP runs.

Sync (3 workers, 2 shards, --checkpoint-every 25) runs calm, then under the storm: the two
parameter hashes must be equal. Async and SSP (2 workers, 1 shard: their runs restart with one
shard only) run under storms of their own and must spend their whole budget. Reported: every fault
(kind, target, moment, recovery time), faults by kind and by moment, the updates lost, the
processes restarted, in OUT/drill.md (markdown), OUT/drill.json, and OUT/drill.png (each fault's
recovery time by moment); the command in OUT/command.txt.

    psgd bench drill --seed 36 --count 14 --steps 300 --out results/bench/drill
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from psgd.bench import record

WORKLOAD = ["--dataset", "mnist1d", "--model", "mlp", "--batch-size", "32", "--eval-every", "0"]


def runs(steps: int) -> dict[str, list[str]]:
    return {
        "sync": ["--mode", "sync", "--workers", "3", "--servers", "2", "--steps", str(steps),
                 "--checkpoint-every", "25", *WORKLOAD],
        "async": ["--mode", "async", "--workers", "2", "--servers", "1", "--steps", str(steps),
                  "--checkpoint-every", "25", *WORKLOAD],
        "ssp": ["--mode", "ssp", "--staleness", "2", "--workers", "2", "--servers", "1", "--steps", str(steps),
                "--checkpoint-every", "25", *WORKLOAD],
    }


def config(flags: list[str], out: Path):
    from psgd.core import config as C  # noqa: PLC0415
    from psgd.core.errors import Parser  # noqa: PLC0415
    from psgd.train.roles import config_from_args  # noqa: PLC0415

    parser = Parser(prog="psgd bench drill")
    C.add_flags(parser)
    return config_from_args(parser.parse_args([*flags, "--out", str(out)]))


def table(rows: list[dict]) -> str:
    lines = ["| run | faults | by kind | by moment | updates lost | run restarts | worker restarts | zygote restarts "
             "| recovery s (median / max) | params | calm run's |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r["faults"]
        calm = (r["calm"][:12] + (" (equal)" if r["calm"] == r["sha"] else " (DIFFERENT)")) if r["calm"] else "-"
        rec = sorted(x for x in f["recovery_s"] if x is not None)
        med = rec[len(rec) // 2] if rec else float("nan")
        lines.append(f"| {r['mode']} | {f['delivered']} of {f['planned']} | {_counts(f['by_kind'])} | "
                     f"{_counts(f['by_moment'])} | {f['updates_lost']} | {f['run_restarts']} | {f['worker_restarts']} "
                     f"| {f['zygote_restarts']} | {med:.2f} / {max(rec, default=float('nan')):.2f} | "
                     f"{r['sha'][:12]} | {calm} |")
    lines += ["", "| run | # | kind | target | moment | at s | recovery s | note |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for i, x in enumerate(r["faults"]["list"]):
            lines.append(f"| {r['mode']} | {i + 1} | {x['kind']} | {x['target']} | {x['moment']} | {x['at_s']:.2f} | "
                         f"{x['recovery_s'] if x['recovery_s'] is not None else '-'} | {x.get('note', '')} |")
    return "\n".join(lines) + "\n"


def _counts(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    from psgd.train.drill import MOMENTS  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8, 4.5))
    marks = {"shard": "o", "worker": "s", "zygote": "^"}
    for j, r in enumerate(rows):
        for x in r["faults"]["list"]:
            if x["recovery_s"] is None:
                continue
            ax.scatter(MOMENTS.index(x["moment"]) + (j - 1) * 0.22, x["recovery_s"], marker=marks[x["kind"]],
                       color=f"C{j}", label=f"{r['mode']} / {x['kind']}")
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles, strict=True))
    ax.legend(seen.values(), seen.keys(), fontsize=7, ncol=3)
    ax.set_xticks(range(len(MOMENTS)), MOMENTS)
    ax.set_ylabel("recovery time (s): kill to the next step")
    ax.set_title("psgd bench drill: each fault's recovery, by moment")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    import dataclasses  # noqa: PLC0415

    from psgd.core.errors import Parser  # noqa: PLC0415
    from psgd.train import drill, launch  # noqa: PLC0415

    p = Parser(prog="psgd bench drill", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=36)
    p.add_argument("--count", type=int, default=14, help="faults in the sync storm (async and SSP get half)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--modes", default="sync,async,ssp")
    p.add_argument("--out", default=record.scratch("bench/drill"), help="folder for the JSON, table, figure "
                   "and command (default: %(default)s, git-ignored)")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "command.txt").write_text("psgd bench drill " + " ".join(argv) + "\n")
    work = out / "runs"
    rows = []
    for mode in a.modes.split(","):
        flags = runs(a.steps)[mode]
        count = a.count if mode == "sync" else max(1, a.count // 2)
        calm = ""
        if mode == "sync":
            calm = launch.run(config(flags, work / f"{mode}-calm"))["params_sha256"]
        cfg = config(flags, work / f"{mode}-storm")
        try:
            s = drill.drill(dataclasses.replace(cfg), a.seed, count)
        except launch.RunFailed as e:
            print(f"psgd bench drill: {mode} storm failed: {e}", file=sys.stderr)
            return 1
        rows.append(dict(mode=mode, faults=s["faults"], sha=s["params_sha256"], calm=calm,
                         global_updates=s.get("global_updates"), budget=cfg.budget))
        print(f"{mode}: {s['faults']['delivered']} faults, {s['faults']['updates_lost']} updates lost, "
              f"hash {s['params_sha256'][:12]}" + (f" (calm {calm[:12]})" if calm else ""), flush=True)
    (out / "drill.json").write_text(json.dumps(rows, indent=1))
    (out / "drill.md").write_text("# psgd bench drill\n\n`" + (out / "command.txt").read_text().strip() + "`\n\n"
                                  + table(rows))
    figure(rows, out / "drill.png")
    print(f"-> {out / 'drill.md'}, {out / 'drill.png'}")
    return 0 if all(r["calm"] in ("", r["sha"]) for r in rows) else 1
