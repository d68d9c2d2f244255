"""Making a suite's runs: one warm parent, torch's CPU kernels pinned, each run made or reused once.

Contract:
- `execute(spec, fresh, position)` makes one run through `launch.run` in this process (its shards
  and workers forked from the suite's one warm parent, `WARM`), or reuses its finished run
  (psgd/lab/runcache.py: cached, or the default profile's twin linked in), and returns its
  summary.json. A run it makes gets config.json as specified (before --epochs is resolved, so the
  cache check matches) and provenance.json (training-code version, command, time, CPU kernels).
- `Runner` walks specs in order on the suite's progress bar; a run that several experiments share
  is made (and counted) once.
- `pin_cpu_kernels()` sets ATEN_CPU_CAPABILITY for the processes the suite starts; `estimate_s`
  is the ETA the suite announces (a guess from fitted rates, never a measurement).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

from psgd.core import config as C
from psgd.lab.experiment import Experiment, RunSpec
from psgd.lab.runcache import is_cached, reuse_twin, twin

__all__ = ["estimate_s", "WarmParent", "WARM", "PINNED_KERNELS", "pin_cpu_kernels", "execute", "Runner"]

# Only for the ETA, fitted to the reference runs on 2 cores (the default profile: 12.2 min for 211
# runs and 2 benchmarks, mostly 96k-sample MLP runs; the transformer suite: 11.0 min for 68 runs):
# start-up from the warm parent (0.46 s on average) plus the evaluation of an MLP run's snapshots,
# and the training samples per second of a typical run.
SECONDS_PER_RUN_START = 1.0
SAMPLES_PER_S = 40000
# The small transformer (E14, E17, E18, E22 at width 64): about 1,950 training samples (windows) per
# second, and about 0.8 s per evaluation of a snapshot on the validation and test text (fitted on the
# transformer suite of fe4506d: 28.0 min for 87 runs of 11 evaluations each, where 2.2 s per run had
# predicted 18.1 min).
SLOWER = {"gpt": (1950, 0.8)}


_SIZES: dict = {}   # DataConfig -> training-set size, for the ETA (see `_train_size`)


def _train_size(cfg) -> int:
    """data.train_size, once per data config: a dataset whose size needs loading (the transformer's
    text) was loaded again for every run of every ETA, and the reference plan asks for a dozen ETAs
    (`python -m psgd.lab.reference plan experiments/transformer.toml ...` ran for minutes)."""
    from psgd.train import data

    if cfg not in _SIZES:
        _SIZES[cfg] = data.train_size(cfg)
    return _SIZES[cfg]


def estimate_s(experiments: list[Experiment], fresh: bool = False) -> float:
    """About how long the runs still to make take (all of them with `fresh`: none is reused)."""
    total, seen = 0.0, set()
    for e in experiments:
        if e.bench:
            total += 60.0
        specs = e.tune_specs() + e.planned_specs()
        for r in specs:
            if r.cfg.out in seen or (not fresh and (is_cached(r) or twin(r) is not None)):
                continue
            seen.add(r.cfg.out)
            cfg = C.with_epochs_resolved(r.cfg, _train_size(r.cfg.data))
            rate, per_eval = SLOWER.get(cfg.model.model, (SAMPLES_PER_S, 0.0))
            # Evaluations: the start, one every eval_every updates, the end.
            evals = 1 + (-(-C.updates(cfg) // cfg.eval_every) if cfg.eval_every > 0 else 1)
            total += SECONDS_PER_RUN_START + per_eval * evals + cfg.steps * cfg.global_batch / rate
    return total


class WarmParent:
    """One warm parent for every run the suite makes (psgd/train/launch.py `warm_parent`): torch is
    imported once per suite, not once per run (about 1.2 s of a run's start-up on 2 cores). Started
    at the first run, replaced if it died, closed when the suite ends (and it dies with the suite's
    process in any case: PR_SET_PDEATHSIG)."""

    def __init__(self, tag: str = "psgd-suite") -> None:
        self.zygote, self.tag = None, tag   # the tag names the warm parent in `ps` (tests: psgd-tests)

    def get(self):
        from psgd.train import launch

        if self.zygote is None or self.zygote.gone:
            self.close()
            self.zygote = launch.warm_parent(self.tag)
        return self.zygote

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None


WARM = WarmParent()

# torch picks its CPU kernels by the machine (AVX2, AVX-512, ...), and a run's last bits follow them:
# the same sync run hashes differently on an AVX-512 machine than on an AVX2 one (measured: 537f4dc0...
# against 41ce5e7b...). The suite pins AVX2, which every x86 machine since 2013 has, so that its runs
# do not change with a machine's vector width; a value the caller set is kept. `machine()` in the
# report and each run's provenance.json name it. It cannot pin everything: matrix products go to
# MKL, which picks its kernels by CPU vendor (measured: one sync case, AMD EPYC and Intel Xeon
# AVX-512, two hashes; tests/numerics.py), so a rerun's bits are the committed ones on the same
# class of CPU; elsewhere a seed can end on other last bits.
PINNED_KERNELS = "avx2"


def pin_cpu_kernels() -> str:
    """Set ATEN_CPU_CAPABILITY for the processes the suite starts (not this one); returns its value."""
    import torch  # noqa: PLC0415

    have = torch.backends.cpu.get_cpu_capability().lower()
    if "ATEN_CPU_CAPABILITY" not in os.environ and have.startswith("avx"):
        os.environ["ATEN_CPU_CAPABILITY"] = PINNED_KERNELS
    return os.environ.get("ATEN_CPU_CAPABILITY", have)


def execute(spec: RunSpec, fresh: bool, position: str, tensorboard: Path | None = None) -> dict:
    """Run one spec (or reuse its cached result); returns its summary. With `tensorboard`, the
    run's curves go to TENSORBOARD/<experiment>/<label>-<phase>-lr<lr>-s<seed> as it trains (a cached
    run's from its files: psgd/train/tboard.py)."""
    from psgd.train import data, launch, progress, rundir

    cached = not fresh and is_cached(spec)
    linked = not fresh and not cached and reuse_twin(spec)
    if cached or linked:
        said = "the default profile's run, linked in" if linked else "cached"
        tqdm.write(f"{position} {spec.experiment} {spec.label} seed {spec.seed}: {said}", file=sys.stderr)
        _tensorboard(spec, tensorboard)
        return json.loads((Path(spec.cfg.out) / "summary.json").read_text())
    cfg = C.with_epochs_resolved(spec.cfg, data.train_size(spec.cfg.data))
    tag = f"{position} {spec.experiment} {spec.label}" + (f" lr={spec.cfg.optim.lr:g}" if spec.phase == "tune" else "")
    if spec.sim:  # a SIMULATED arm: psgd run --simulate, in this process (psgd/sim/)
        from psgd.sim.run import SimConfig, simulate

        tqdm.write(f"{tag} s{spec.seed}: SIMULATED", file=sys.stderr)
        summary = simulate(cfg, SimConfig(**spec.sim))
    else:
        with progress.live(Path(cfg.out), cfg.budget, f"{tag} s{spec.seed}"):
            summary = launch.run(cfg, zygote=WARM.get(), tensorboard=_tensorboard_dir(spec, tensorboard))
    # Record the config as specified (before --epochs was resolved), so the cache check matches.
    out = Path(cfg.out)
    (out / "config.json").write_text(json.dumps(rundir.config_record(spec.cfg), indent=1))
    (out / "provenance.json").write_text(json.dumps({"code_version": spec.version, "command": spec.command,
                                                     "made_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                                     "cpu_kernels": os.environ.get("ATEN_CPU_CAPABILITY", "")},
                                                    indent=1))
    return summary


def _tensorboard_dir(spec: RunSpec, tensorboard: Path | None) -> Path | None:
    """TENSORBOARD/<experiment>/<label>-<phase>-lr<lr>-s<seed>: a run's curves, written as it trains."""
    if tensorboard is None:
        return None
    name = f"{spec.label}-{spec.phase}-lr{spec.cfg.optim.lr:g}-s{spec.seed}".replace(" ", "_").replace("/", "_")
    return tensorboard / spec.experiment / name


def _tensorboard(spec: RunSpec, tensorboard: Path | None) -> None:
    """A cached run's curves, from its files (psgd/train/tboard.py `write`)."""
    if tensorboard is not None:
        from psgd.train import tboard

        tboard.write(Path(spec.cfg.out), _tensorboard_dir(spec, tensorboard))


class Runner:
    """A suite's runs on its progress bar: a run experiments share is made once; `reused` counts those found."""

    def __init__(self, overall: tqdm, fresh: bool, tensorboard: Path | None) -> None:
        self.overall, self.fresh, self.tensorboard = overall, fresh, tensorboard
        self.reused, self.total_runs = 0, 0
        self.done_outs: set[str] = set()   # the runs made (or reused) so far: a shared run is counted once

    def expect(self, steps: int) -> None:
        """The bar's total: the steps made so far and `steps` still to come. Set before each experiment,
        as the rates its tuning chose (and the runs those share) are known only then."""
        self.overall.total = self.overall.n + steps
        self.overall.refresh()

    def run_all(self, specs: list[RunSpec]) -> list[tuple[RunSpec, dict]]:
        """Run (or reuse) each spec in order; returns each with its summary."""
        out = []
        for spec in specs:
            first = spec.cfg.out not in self.done_outs
            if first and self.overall.n >= (self.overall.total or 0):
                self.expect(1)   # a grid grown past its end (tuning.py): a run the plan did not count
            if first:
                self.reused += int(not self.fresh and (is_cached(spec) or twin(spec) is not None))
                self.total_runs += 1
            step = self.overall.n + int(first)   # a run met again is no new step
            out.append((spec, execute(spec, self.fresh and first, f"[{step}/{self.overall.total}]", self.tensorboard)))
            if first:
                self.done_outs.add(spec.cfg.out)
                self.overall.update(1)
        return out
