"""`psgd model`: the alpha-beta cost model (psgd/core/costmodel.py) on the command line.

Contract: reads this machine's fitted numbers from `--calibration` (written by
`psgd bench calibrate`; built-in defaults, said so, when the file is missing), predicts one step
of PS sync (K shards) and the ring all-reduce for every `--bandwidth` and N in `--workers`, and
writes OUT/model.csv, OUT/model.png (samples/s vs N, log-log) and OUT/command.txt. It prints one
samples/s table per distinct prediction: neighbouring bandwidths that predict the same (the wire
outruns the software at all of them) share one table, "10gbit = 100gbit (software-bound)". With
`--validate CSV` (the scaling sweep's scaling.csv) it compares measured and predicted step times
on this machine (one host, the calibrated cores), lists every point off by more than 25% and
writes OUT/validation.csv and OUT/validation-command.txt.

    psgd model --bandwidth 10gbit,100gbit,400gbit --workers 8..1024
    psgd model --validate results/bench/scaling/scaling.csv
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
from pathlib import Path

from psgd.bench import record
from psgd.core import costmodel as cm
from psgd.core import link, palette


def load_calibration(path: str) -> tuple[cm.Machine, cm.Workload, dict]:
    """(machine, workload, raw JSON) from a calibration file; defaults when path is "" or missing."""
    if path and Path(path).exists():
        raw = json.loads(Path(path).read_text())
        return cm.machine_from_dict(raw["machine"]), cm.workload_from_dict(raw["workload"]), raw
    return cm.Machine(), cm.Workload(), {}


def validation_table(rows: list[dict], tolerance: float = 0.25) -> str:
    lines = ["mode  N  K  measured s  predicted s  error   (compute, comm predicted)"]
    for r in rows:
        flag = "" if r["within"] else f"  <-- off by more than {tolerance:.0%}"
        lines.append(f"{r['mode']:>4} {int(r['workers']):>2} {int(r['shards'] or 0):>2}  {r['step_s']:>10.3f}  "
                     f"{r['predicted_s']:>11.3f}  {r['error']:>+6.0%}   ({r['predicted_compute_s']:.3f}, "
                     f"{r['predicted_comm_s']:.3f}){flag}")
    off = [r for r in rows if not r["within"]]
    where = ", ".join(f"{r['mode']} N={r['workers']} K={r['shards']}" for r in off)
    verdict = f"{len(rows) - len(off)} of {len(rows)} within {tolerance:.0%}"
    lines.append(verdict + (f"; off at: {where}" if off else ""))
    return "\n".join(lines)


def read_measured(path: Path) -> list[dict]:
    """Rows of a scaling CSV that ran: mode, workers, shards, batch, step_s."""
    out = []
    with open(path) as f:
        for r in csv.DictReader(f):
            if r.get("status", "ok") != "ok" or not r.get("step_s") or r.get("overlap") == "True":
                continue  # the model has no --overlap
            out.append({"mode": r["mode"], "workers": int(r["workers"]), "shards": int(r["shards"] or 0),
                        "batch": int(r["batch"]), "step_s": float(r["step_s"])})
    return out


def format_tables(rows: list[dict], bandwidths: list[str], workers: list[int], capped: list[str]) -> str:
    """The samples/s tables, one per distinct prediction: consecutive bandwidths whose predictions
    are identical share one table titled with all their names, e.g. "10gbit = 100gbit (software-bound)".
    Where the software is slower than every wire, one table says so instead of repeating itself."""
    def table(bw: str) -> tuple[list, list]:
        cols = list(dict.fromkeys((r["mode"], r["shards_label"]) for r in rows if r["bandwidth"] == bw))
        vals = {(r["workers"], r["mode"], r["shards_label"]): r["samples_per_s"] for r in rows if r["bandwidth"] == bw}
        return cols, [[vals[(n, *c)] for c in cols] for n in workers]

    groups: list[tuple[list[str], tuple[list, list]]] = []
    for bw in bandwidths:
        t = table(bw)
        if groups and groups[-1][1] == t:  # exact: a capped link's beta is the software's, bit for bit
            groups[-1][0].append(bw)
        else:
            groups.append(([bw], t))
    lines = []
    for names, (cols, values) in groups:
        why = " (software-bound)" if len(names) > 1 and set(names) <= set(capped) else ""
        lines += ["", f"{' = '.join(names)}{why}: samples/s",
                  "     N  " + "  ".join(f"{'ring' if m == 'ring' else 'PS K=' + k:>10}" for m, k in cols)]
        lines += [f"{n:>6}  " + "  ".join(f"{v:>10.0f}" for v in row) for n, row in zip(workers, values, strict=True)]
    return "\n".join(lines)


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def plot(rows: list[dict], path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    bandwidths = list(dict.fromkeys(r["bandwidth"] for r in rows))
    colors = palette.VARIANT_COLORS  # bandwidths are not modes
    def key(r: dict) -> tuple:
        return r["bandwidth"], r["mode"], r["shards_label"]

    shards = list(dict.fromkeys(r["shards_label"] for r in rows if r["mode"] != "ring"))
    for line in dict.fromkeys(key(r) for r in rows):
        pts = [(r["workers"], r["samples_per_s"]) for r in rows if key(r) == line]
        bw, mode, k = line
        # A dash per configuration (K=8 and K=N were both dotted) and, per bandwidth, a colour, a marker
        # and a width that narrows as it rises, drawn on top: where a faster link predicts the same
        # (software-bound), its thin line runs inside the slower one's instead of hiding it.
        style = "-" if mode == "ring" else palette.LINESTYLES[1 + shards.index(k) % 3]
        i = bandwidths.index(bw)
        label = f"{bw}: ring all-reduce" if mode == "ring" else f"{bw}: PS sync, K={k}"
        ax.plot(*zip(*pts, strict=True), linestyle=style, marker=palette.VARIANT_MARKERS[i % 6],
                ms=max(3.0, 7.5 - 2.0 * i), lw=max(0.8, 3.0 - 1.0 * i), zorder=2 + i, label=label,
                color=colors[i % len(colors)])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers N")
    ax.set_ylabel("predicted throughput (samples / s)")
    ax.set_title(title, fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def _parser() -> argparse.ArgumentParser:
    """The flags of `psgd model` (a psgd.core.errors.Parser, not yet parsed)."""
    from psgd.core.errors import Parser

    p = Parser(prog="psgd model", description="Predict PS vs ring all-reduce throughput with the alpha-beta model.")
    p.add_argument("--bandwidth", default="10gbit,100gbit,400gbit", help="link speeds, comma-separated")
    p.add_argument("--latency", default="5us", help="one-way wire latency added to the calibrated alpha")
    p.add_argument("--workers", default="8..1024", help="N values: LO..HI (powers of two) or a comma list")
    p.add_argument("--shards", default="1,8,N", help="PS shard counts K to model (N: one shard per worker)")
    p.add_argument("--params", type=float, default=0, help="model parameters (default: the calibrated model's)")
    p.add_argument("--batch", type=int, default=0, help="samples per worker per step (default: calibrated)")
    p.add_argument("--jitter", type=float, default=0.0, metavar="MS",
                   help="mean exponential straggler delay per step, ms (as psgd run --jitter)")
    # One name across subcommands; the old one still works, so scripts that used it keep running.
    p.add_argument("--jitter-ms", dest="jitter", type=float, default=argparse.SUPPRESS, metavar="MS",
                   help="(old name of --jitter)")
    p.add_argument("--software-bound", action=argparse.BooleanOptionalAction, default=True,
                   help="a link moves no more than the calibrated software does (--no-software-bound: wire only)")
    p.add_argument("--calibration", default=record.calibration(), help="psgd bench calibrate's JSON (default: "
                   "its newest in results/tmp/bench, else the committed one: %(default)s)")
    p.add_argument("--validate", default="", metavar="CSV", help="compare with a scaling sweep's measured steps")
    p.add_argument("--out", default=record.scratch("model"), help="folder for model.csv, model.png, command.txt "
                   "(default: %(default)s, git-ignored)")
    return p


def _grid(a: argparse.Namespace) -> tuple[list[tuple[str, float, float]], list[int], list[str]]:
    """(bandwidths as (name, bits/s, latency s), worker counts, shard counts) of the flags; UsageError if bad."""
    from psgd.core.errors import UsageError

    try:
        bandwidths = [(b.strip(), link.parse(b).bits_per_s, link.parse(f"1gbit,{a.latency}").latency_s)
                      for b in a.bandwidth.split(",") if b.strip()]
        workers = cm.parse_workers(a.workers)
    except ValueError as e:
        raise UsageError(str(e).replace("--link", "--bandwidth / --latency")) from None
    shards = [s.strip() for s in a.shards.split(",") if s.strip()]
    if not bandwidths or not shards or not all(s == "N" or (s.isdigit() and int(s) >= 1) for s in shards):
        raise UsageError("--bandwidth needs at least one speed; --shards takes integers >= 1 or N")
    if a.params < 0 or a.batch < 0 or a.jitter < 0:
        raise UsageError("--params, --batch and --jitter must be >= 0")
    return bandwidths, workers, shards


def _validation(a: argparse.Namespace, out: Path, command: str, machine: cm.Machine, work: cm.Workload) -> None:
    """--validate: the model beside a sweep's measured steps, OUT/validation.csv and the table printed."""
    from psgd.core.errors import UsageError

    # Read before anything is written: a CSV that is missing or not a sweep's is one line, and no
    # command file is left for a validation that never ran.
    try:
        measured = read_measured(Path(a.validate))
    except OSError as e:
        raise UsageError(f"--validate {a.validate}: {e.strerror}") from None
    except (KeyError, ValueError) as e:
        raise UsageError(f"--validate {a.validate}: not a scaling sweep's CSV (psgd bench scaling's scaling.csv): "
                         f"{type(e).__name__}: {e}") from None
    if not measured:
        raise UsageError(f"no measured rows in {a.validate}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "validation-command.txt").write_text(command)
    rows = cm.validate(measured, machine, work)
    write_csv(rows, out / "validation.csv")
    print(validation_table(rows))


def _prediction(a: argparse.Namespace, out: Path, command: str, machine: cm.Machine, work: cm.Workload,
                grid: tuple[list[tuple[str, float, float]], list[int], list[str]]) -> None:
    """The prediction over the grid (`_grid`): OUT/model.csv, OUT/model.png and the tables printed."""
    bandwidths, workers, shards = grid
    out.mkdir(parents=True, exist_ok=True)
    (out / "command.txt").write_text(command)
    rows = cm.predict(machine, work, bandwidths, workers, shards, a.software_bound)
    write_csv(rows, out / "model.csv")
    title = (f"alpha-beta model: {work.params / 1e6:.1f}M params, batch {work.batch}/worker, alpha "
             f"{machine.alpha_s * 1e6:.0f} us + {a.latency}; software alone moves "
             f"{1 / machine.beta_s_per_byte / 1e9:.2f} GB/s (PS), "
             f"{1 / machine.ring_beta_s_per_byte / 1e9:.2f} GB/s (ring)"
             + ("" if a.software_bound else " (ignored: wire only)"))
    plot(rows, out / "model.png", title)
    print(title)
    capped = [bw for bw, bits, _ in bandwidths if a.software_bound and 8.0 / bits < machine.beta_s_per_byte]
    print(format_tables(rows, [bw for bw, _, _ in bandwidths], workers, capped))
    if capped:
        print(f"\nnote: at {', '.join(capped)} the wire outruns the software (psgd's PS moves "
              f"{1 / machine.beta_s_per_byte / 1e9:.2f} GB/s per process here): those predictions are software-bound; "
              "--no-software-bound shows the wire alone")
    print(f"\nwrote {out / 'model.csv'}, {out / 'model.png'}")


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    grid = _grid(a)
    machine, work, raw = load_calibration(a.calibration)
    if not raw:
        print(f"psgd model: no calibration at {a.calibration!r}: using built-in defaults "
              "(run `psgd bench calibrate` for this machine's numbers)", file=sys.stderr)
    work = dataclasses.replace(work, params=int(a.params or work.params), batch=a.batch or work.batch,
                               jitter_s=a.jitter / 1000.0)
    out = Path(a.out)
    command = "psgd model " + " ".join(argv) + "\n"
    if a.validate:
        _validation(a, out, command, machine, work)
    else:
        _prediction(a, out, command, machine, work, grid)
    return 0
