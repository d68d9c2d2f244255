"""The public Python API (psgd/api.py): psgd.fit for whole jobs, start_shards / connect for your own loop."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import psgd
from psgd.core.config import OptimConfig
from psgd.core.errors import ExchangeError
from tests.user_workload import TinyNet, make_data

U = "tests.user_workload"


def test_import_psgd_stays_light_and_exports_the_api():
    code = ("import sys, psgd\nassert 'torch' not in sys.modules\n"
            "assert callable(psgd.fit) and callable(psgd.connect) and callable(psgd.start_shards)\n"
            "assert psgd.AdamW(lr=1e-3).optimizer == 'adamw'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    with pytest.raises(AttributeError):
        psgd.no_such_thing  # noqa: B018


@pytest.mark.usefixtures("warm_runs")  # the job (launch.run) forks from the warm parent
def test_fit_runs_the_job_and_returns_the_summary_and_the_trained_model(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="psgd")  # what a program's logging.basicConfig(level=DEBUG) sees
    result = psgd.fit(model=TinyNet, data=make_data, mode="sync", workers=2, servers=2, steps=15, batch_size=16,
                      optimizer=psgd.AdamW(lr=5e-3), out=str(tmp_path / "fit"), eval_every=0)
    said = "\n".join(f"{r.name} {r.levelname} {r.getMessage()}" for r in caplog.records)
    for line in ("psgd.api.jobs INFO psgd.fit: sync, 2 workers, model tests.user_workload:TinyNet",
                 "psgd.train.launch INFO " + str(tmp_path / "fit") + ": sync run, 2 workers, 2 shards",
                 "psgd.train.launch DEBUG " + str(tmp_path / "fit") + ": shards ready at 127.0.0.1:",
                 "psgd.train.supervise DEBUG worker 1/2 finished",
                 "psgd.train.launch DEBUG " + str(tmp_path / "fit") + ": training ended; evaluating",
                 "psgd.train.launch INFO " + str(tmp_path / "fit") + ": finished, 15 updates, summary in"):
        assert line in said, said
    assert result.summary["global_updates"] == 15 and result.summary["mode"] == "sync"
    final = torch.load(tmp_path / "fit" / "final_params.pt", weights_only=True)
    assert torch.equal(torch.nn.utils.parameters_to_vector(result.model.parameters()), final)
    x, y = make_data()[1]
    with torch.no_grad():
        loss = float(F.cross_entropy(result.model(x), y))
    assert loss == pytest.approx(result.summary["final_test_loss"], rel=1e-5)
    assert result.config.optim.optimizer == "adamw" and result.config.model.model == f"{U}:TinyNet"


@pytest.mark.parametrize(("kw", "says"), [
    (dict(model=lambda: nn.Linear(6, 3)), "a lambda or a nested function cannot be imported"),
    (dict(batchsize=8), "batchsize= is not a psgd run flag"),
    (dict(workers="2"), "--workers takes an integer, got '2'"),
    (dict(workers=0), "--workers must be >= 1"),
    (dict(lr=0.1, optimizer=psgd.SGD()), "lr= and optimizer= both set the optimizer"),
    (dict(model=f"{U}:with_batchnorm", data=f"{U}:make_data"), "BatchNorm"),
    (dict(straggler={0: "slow"}), "--straggler takes {RANK: N}"),
])
def test_fit_refuses_a_bad_keyword_or_value_before_anything_starts(tmp_path, kw, says):
    out = tmp_path / "never"
    with pytest.raises(ValueError, match=None) as e:
        psgd.fit(out=str(out), **kw)
    assert says in str(e.value)
    assert not out.exists()


def test_a_main_function_is_refused_with_the_spec_to_use_instead():
    code = ("import psgd\nfrom torch import nn\ndef make():\n    return nn.Linear(2, 2)\n"
            "try:\n    psgd.fit(model=make)\nexcept ValueError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "defined in __main__" in done.stdout and 'model="FILE.py:make"' in done.stdout, done.stderr


# -- the low level: your own loop ------------------------------------------------------------------
N, STEPS, B = 3, 12, 8


def batches(rank: int, workers: int = N):
    (x, y), _ = make_data()
    for t in range(STEPS):
        lo = t * workers * B + rank * B
        yield x[lo:lo + B], y[lo:lo + B]


def fresh_models(n: int) -> list[nn.Module]:
    out = []
    for _ in range(n):  # built before the threads: init draws from torch's global generator
        torch.manual_seed(0)
        out.append(TinyNet())
    return out


def run_workers(addresses, models, loop, workers=N, **connect) -> list[BaseException]:
    errors: list[BaseException] = []

    def work(rank):
        try:
            with psgd.connect(models[rank], addresses, rank=rank, workers=workers, rpc_timeout=60, **connect) as w:
                loop(rank, w, models[rank])
        except BaseException as e:  # surfaced by the caller's assertion
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    return errors


def reference_sgd() -> torch.Tensor:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    (x, y), _ = make_data()
    for t in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(model(x[t * N * B:(t + 1) * N * B]), y[t * N * B:(t + 1) * N * B]).backward()
        opt.step()
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


@pytest.mark.parametrize("style", ["pull-push", "step", "set_to_none", "separate-pull"])
def test_your_own_loop_in_sync_equals_single_process_training(style):
    """Three workers' loops (pull, backward, push) against two shards end where one process with
    torch.optim.SGD at 3x the batch ends, however the loop is written: pull / push, step(), torch's
    zero_grad(set_to_none=True) after every push (psgd restores its gradient views), or two round
    trips per step."""
    models = fresh_models(N)

    def loop(rank, w, model):
        w.pull()
        for x, y in batches(rank):
            F.cross_entropy(model(x), y).backward()
            if style == "step":
                w.step()
            else:
                w.push()
                if style == "set_to_none":
                    model.zero_grad(set_to_none=True)
                w.pull()
        assert w.clock == STEPS

    with psgd.start_shards(servers=2, workers=N, mode="sync", optimizer=psgd.SGD(lr=0.1, momentum=0.9)) as shards:
        assert run_workers(shards.addresses, models, loop, separate_pull=style == "separate-pull") == []
        assert shards.wait(30)
        got = shards.params()
        assert [s["version"] for s in shards.stats()] == [STEPS, STEPS]
    want = reference_sgd()
    assert (got - want).abs().max() < 1e-5
    assert (got - torch.nn.utils.parameters_to_vector(fresh_models(1)[0].parameters())).abs().max() > 1e-2


@pytest.mark.parametrize("mode", ["sync", "ssp", "async"])
def test_a_worker_that_finishes_early_leaves_and_holds_nobody(mode):
    """Worker 2 runs out of batches after 3 steps; the others go on to 12 without waiting for it
    (sync: the later steps are the mean of the two that remain; SSP: its clock no longer bounds)."""
    models = fresh_models(N)

    def loop(rank, w, model):
        for i, (x, y) in enumerate(batches(rank)):
            if rank == 2 and i == 3:
                return
            w.pull()
            F.cross_entropy(model(x), y).backward()
            w.push()

    with psgd.start_shards(workers=N, mode=mode, staleness=1, optimizer=psgd.SGD(lr=0.05)) as shards:
        assert run_workers(shards.addresses, models, loop) == []
        assert shards.wait(30)
        stats = shards.stats()[0]
    assert stats["version"] == (STEPS if mode == "sync" else 2 * STEPS + 3)


def test_a_budget_ends_every_loop_and_errors_are_clear():
    models = fresh_models(2)
    seen = {}

    def loop(rank, w, model):
        for x, y in batches(rank, 2):
            if not w.pull():
                break
            F.cross_entropy(model(x), y).backward()
            w.push()
        seen[rank] = (w.done, w.clock)

    with psgd.start_shards(workers=2, mode="sync", steps=5) as shards:
        assert run_workers(shards.addresses, models, loop, workers=2) == []
    assert seen == {0: (True, 5), 1: (True, 5)}
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        psgd.connect(TinyNet(), "127.0.0.1:1", rank=2, workers=2)
    with pytest.raises(ValueError, match="HOST:PORT"):
        psgd.connect(TinyNet(), "nowhere", rank=0)
    with pytest.raises(ValueError, match="no shards"):
        psgd.start_shards(mode="allreduce")
    with pytest.raises(ValueError, match="--staleness must be >= 0"):
        psgd.start_shards(mode="ssp", staleness=-1)
    with pytest.raises(ValueError, match="BatchNorm"):
        with psgd.start_shards() as shards:
            psgd.connect(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), shards.addresses)


def test_a_stopped_shard_is_an_exchange_error_not_a_hang():
    models = fresh_models(1)
    shards = psgd.start_shards(workers=1, mode="async")
    with psgd.connect(models[0], shards.addresses, rpc_timeout=10) as w:
        w.pull()
        F.cross_entropy(models[0](make_data()[0][0][:4]), make_data()[0][1][:4]).backward()
        w.push()
        shards.stop()
        with pytest.raises(ExchangeError):
            w.push()
            w.pull()
            w.push()


def test_optimizer_objects_are_the_flags():
    assert psgd.SGD(lr=0.2, momentum=0.5) == OptimConfig(lr=0.2, momentum=0.5)
    assert psgd.AdamW(betas=(0.8, 0.9)) == OptimConfig(optimizer="adamw", lr=1e-3, beta1=0.8, beta2=0.9,
                                                       weight_decay=0.01)
    assert psgd.api.config(optimizer=psgd.AdamW(lr=2e-3), workers=3).optim.lr == 2e-3


def test_backup_workers_with_more_than_b_early_leavers_do_not_hang():
    """Sync with b = 1 and two of three workers leaving early: the last one's steps are made from its
    own gradients (the quorum follows the workers still in), not held until the deadline."""
    models = fresh_models(N)

    def loop(rank, w, model):
        for i, (x, y) in enumerate(batches(rank)):
            if rank < 2 and i == 2:
                return
            w.pull()
            F.cross_entropy(model(x), y).backward()
            w.push()

    with psgd.start_shards(workers=N, mode="sync", backup_workers=1, steps=STEPS) as shards:
        assert run_workers(shards.addresses, models, loop, backup_workers=1) == []
        assert shards.wait(30)
    with pytest.raises(ValueError, match="a worker's setting"):
        psgd.start_shards(local_steps=4)
