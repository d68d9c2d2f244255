"""Evaluation and the summary: a run's snapshots evaluated, OUT/final_params.pt and summary.json written.

Contract:
- `finish(cfg, ds, on_eval)`: when the run has ended (every worker's `worker_end`, or declared
  lost; every shard's snapshot file), evaluate each snapshot (psgd/train/evaluate.py) on the test
  set, a training subset and, with --val-fraction, the validation split; write the eval lines,
  final_params.pt and summary.json (psgd/train/metrics.py `summarize`). RunFailed naming what is
  missing when the run has not ended. Run again on the same folder it gives the same files: the
  eval lines of an earlier call are replaced, not doubled. `psgd summarize OUT` runs it too.
- `in_fork(cfg, zygote)`: `finish` for `psgd run`, in a child of the run's warm parent when there
  is one (`psgd summarize --of-run`): it has torch loaded, so the launcher never imports it. The
  child reports `evaluating K N` (EVAL_LINE) on stdout before snapshot K of N, for the live line;
  its failure is the run's, in the same words; when its warm parent is gone (which takes its forks
  along) the launcher evaluates itself, as it does without a warm parent (--cold-start, cluster
  hosts), and a child killed otherwise fails the run naming the signal. `$PSGD_FINISH_FAULT=kill`
  makes the child SIGKILL its warm parent before it evaluates (a drill's or a test's fault).
- summary.json's `loss_rose` ({low, at, last}) is there when the training loss rose at the end of
  the run (psgd/train/divergence.py); `psgd run` prints its warning after the summary line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from psgd.core.config import RunConfig, to_dict
from psgd.train.metrics import Metrics, read_events, samples_per_update, summarize
from psgd.train.supervise import Child, RunFailed, stop
from psgd.train.warm import Zygote

if TYPE_CHECKING:
    import torch

    from psgd.train import data as data_mod

log = logging.getLogger(__name__)
FAULT = "PSGD_FINISH_FAULT"  # drills and tests: `kill` makes psgd run's evaluation child SIGKILL its warm parent
EVAL_LINE = "evaluating"  # `psgd summarize --of-run`'s stdout: `evaluating K N` before snapshot K of N
# The final evaluation's figures, when the last snapshot is the final state.
FINAL_KEYS = ("test_loss", "test_accuracy", "train_loss", "val_loss", "val_accuracy")


def inject_fault() -> None:
    """In `psgd summarize --of-run` (in_fork's child): with `$PSGD_FINISH_FAULT=kill`, SIGKILL the
    warm parent this child was forked from, and this child (a storm's fault after training)."""
    if os.environ.get(FAULT) == "kill":
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def in_fork(cfg: RunConfig, zygote: Zygote | None) -> dict:
    """`finish` in a fork of the run's warm parent (see the module docstring); returns the summary."""
    if zygote is None or zygote.gone:
        return finish(cfg)
    out = Path(cfg.out)
    argv = [sys.executable, "-m", "psgd", "summarize", str(out), "--of-run", json.dumps(to_dict(cfg))]
    child = Child("the evaluation", argv, out / "logs" / "finish.log", dict(os.environ), capture_stdout=True,
                  zygote=zygote)
    try:
        from psgd.train import progress  # noqa: PLC0415 - tqdm, for the live line only

        for line in child.proc.stdout:
            word, k, n = (line.decode().split() + ["", "", ""])[:3]
            if word == EVAL_LINE:
                progress.evaluating(int(k), int(n))
        code = child.proc.wait()
    except BaseException:
        stop([child], signal.SIGKILL)
        raise
    if code < 0 and zygote.gone:
        # Its warm parent went (and took it along: its forks die with it). The training has ended
        # and `finish` is idempotent: evaluate here. Killed otherwise (out of memory, say), it fails
        # the run below, naming the signal: the same evaluation here would meet the same end.
        log.warning("psgd run: the evaluation's warm parent died (and with it the evaluation, signal %s); "
                    "evaluating in the launcher", signal.Signals(-code).name)
        return finish(cfg)
    if code < 0:
        raise RunFailed(f"the evaluation died with signal {signal.Signals(-code).name}: {child.last_error()}")
    if code != 0:
        raise RunFailed(child.last_error().removeprefix("psgd summarize: failed: "))
    return json.loads((out / "summary.json").read_text())


def finish(cfg: RunConfig, ds: data_mod.Dataset | None = None, on_eval=None) -> dict:
    """Evaluate the snapshots, write final_params.pt and summary.json (see the module docstring).
    `ds`: the run's dataset, loaded here when not given. `on_eval(k, n)`: told before snapshot k
    of n is evaluated (default: the live line's `evaluating k/n`)."""
    import torch  # noqa: PLC0415 - the launcher imports torch only here, after training

    from psgd.core import codec  # noqa: PLC0415
    from psgd.train import data as data_mod  # noqa: PLC0415
    from psgd.train import evaluate, models, progress  # noqa: PLC0415

    out = Path(cfg.out)
    ends = _ended(cfg, out)
    ds = ds or data_mod.load(cfg.data)
    model = models.build(cfg.model, ds.input_dim, ds.num_classes, cfg.seed)
    if cfg.mode == "allreduce":
        snaps = torch.load(out / "replica-0.pt", weights_only=True)["snapshots"]
        final, shard_stats = snaps[-1][2], []
    else:
        snaps = evaluate.load_shard_snapshots(out, cfg.servers)
        final = evaluate.load_final_params(out, cfg.servers)
        if cfg.embeddings != "dense":  # the tables' rows were served apart: joined back (rowfinish.py)
            from psgd.train import rowfinish  # noqa: PLC0415

            snaps, final = rowfinish.full(out, cfg, model, snaps, final)
        shard_stats = [json.loads((out / f"shard-{k}.json").read_text()) for k in range(cfg.servers)]
    t0 = min(e["train_start"] for e in ends)
    metrics = Metrics(out / "metrics.jsonl")
    evals = []
    for version, t, params in evaluate.each_snapshot(snaps, on_eval or progress.evaluating):  # evaluating k/n
        e = dict(version=version, elapsed_s=max(0.0, t - t0), samples=version * samples_per_update(cfg),
                 **_evaluate(cfg, model, params, ds))
        metrics.write(event="eval", **e)
        evals.append(e)
    metrics.close()
    if evals and torch.equal(final, snaps[-1][2]):
        # The last snapshot is the final state (a shard's is taken at shutdown): its numbers, not
        # the same evaluation twice.
        final_eval = {k: v for k, v in evals[-1].items() if k in FINAL_KEYS}
    else:
        final_eval = {k: v for k, v in _evaluate(cfg, model, final, ds).items() if k != "train_accuracy"}
    torch.save(final, out / "final_params.pt")
    sha = codec.sha256(final)
    return summarize(out, cfg, evals + [final_eval], models.num_params(model), sha, shard_stats, _extra(cfg, sha))


def _loss_rise(out: Path) -> dict | None:
    """summary.json's `loss_rose`: the training loss's rise at the end of the run (divergence.py), or None."""
    from psgd.train.divergence import rise  # noqa: PLC0415 - read once, at the end

    found = rise([e["loss"] for e in read_events(out / "metrics.jsonl") if e.get("event") == "step" and "loss" in e])
    return None if found is None else dataclasses.asdict(found)


def _ended(cfg: RunConfig, out: Path) -> list[dict]:
    """The workers' `worker_end` lines, once the run has ended (RunFailed naming what is missing
    otherwise); an earlier call's eval lines are dropped, so that this one's replace them."""
    events = read_events(out / "metrics.jsonl")
    ends = [e for e in events if e.get("event") == "worker_end"]
    lost = {e["rank"] for e in events if e.get("event") == "worker_lost"} | _declared_lost(out, cfg)
    if len(ends) + len(lost - {e["rank"] for e in ends}) < cfg.workers:
        raise RunFailed(f"{out}: {len(ends)} of {cfg.workers} workers finished (worker_end in metrics.jsonl): "
                        "has the run ended?")
    owners = ["replica-0"] if cfg.mode == "allreduce" else [f"shard-{k}" for k in range(cfg.servers)]
    for name in owners:
        if not (out / f"{name}.pt").exists():
            who = "all-reduce rank 0" if cfg.mode == "allreduce" else f"server {name.split('-')[1]}"
            raise RunFailed(f"{out} has no {name}.pt: {who} has not stopped yet (it writes it when every "
                            "worker has left, or on Ctrl-C)")
    if any(e.get("event") == "eval" for e in events):
        kept = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events if e.get("event") != "eval")
        tmp = out / "metrics.jsonl.tmp"
        tmp.write_text(kept)
        os.replace(tmp, out / "metrics.jsonl")
    return ends


def _evaluate(cfg: RunConfig, model, params: torch.Tensor, ds: data_mod.Dataset) -> dict:
    """Test and train loss and accuracy of `params`, and the validation split's when there is one.
    Train loss on a fixed subset of about 10,000 targets: cheap (a text window holds 64 of them)."""
    from psgd.train import evaluate  # noqa: PLC0415 - torch

    subset = max(1, 10_000 // max(1, ds.y_train[0].numel()))
    test_loss, test_acc = evaluate.evaluate(model, params, ds.x_test, ds.y_test, cfg.model.loss)
    train_loss, train_acc = evaluate.evaluate(model, params, ds.x_train[:subset], ds.y_train[:subset], cfg.model.loss)
    found = dict(test_loss=test_loss, test_accuracy=test_acc, train_loss=train_loss, train_accuracy=train_acc)
    if len(ds.x_val):  # no split with --val-fraction 0; `text` always has one (by position)
        found["val_loss"], found["val_accuracy"] = evaluate.evaluate(model, params, ds.x_val, ds.y_val,
                                                                     cfg.model.loss)
    return found


def _extra(cfg: RunConfig, sha: str) -> dict | None:
    """summary.json's parts beyond the PS modes': the all-reduce replicas', the cluster's."""
    extra = None
    if cfg.mode == "allreduce":
        from psgd.allreduce.collective import summary_extra  # noqa: PLC0415 - only the collective mode needs it

        extra = summary_extra(Path(cfg.out), sha)
    if (Path(cfg.out) / "cluster.json").exists():  # the hosts and the link a --hosts run used (psgd/train/hosts.py)
        extra = dict(extra or {}, cluster=json.loads((Path(cfg.out) / "cluster.json").read_text()))
    if cfg.embeddings != "dense":  # per-row staleness, the rows' load per shard (psgd/train/rowfinish.py)
        from psgd.train import rowfinish  # noqa: PLC0415

        extra = dict(extra or {}, **rowfinish.summary_extra(Path(cfg.out), cfg))
    rose = _loss_rise(Path(cfg.out))
    if rose is not None:
        extra = dict(extra or {}, loss_rose=rose)
    return extra


def _declared_lost(out: Path, cfg: RunConfig) -> set[int]:
    """The ranks a shard declared lost (its lease ran out): a run without psgd run's launcher (by
    hand, torchrun, Slurm) has no worker_lost events, only the shards' word in shard-K.json."""
    if cfg.mode == "allreduce":
        return set()
    lost: set[int] = set()
    for k in range(cfg.servers):
        path = out / f"shard-{k}.json"
        if path.exists():
            lost |= {int(w) for w in json.loads(path.read_text()).get("lost_workers", {})}
    return lost
