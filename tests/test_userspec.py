"""Your model, data and loss by import path: resolution, the one-line refusals, the runs they make.

The callables live in tests/user_workload.py (module specs, `tests.user_workload:...`) or in a file
the test writes (file specs, `path/x.py:...`)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from psgd.core.config import DataConfig, ModelConfig, OptimConfig, RunConfig, validate
from psgd.lab.experiment import run_digest
from psgd.train import data, evaluate, losses, models, userspec, workload
from tests.helpers import ENV, psgd, psgd_main, summary, train_in_threads

U = "tests.user_workload"


def cfg_of(model=f"{U}:make_model", dataset=f"{U}:make_data", loss="cross_entropy", **kw) -> RunConfig:
    return validate(RunConfig(model=ModelConfig(model=model, loss=loss), data=DataConfig(dataset=dataset),
                              device="cpu", **kw))


def refusal(**kw) -> str:
    with pytest.raises(userspec.SpecError) as e:
        workload.check(cfg_of(**kw))
    message = str(e.value)
    assert "\n" not in message
    return message


# -- what is refused, and how it says so -------------------------------------------------------------
@pytest.mark.parametrize(("kw", "says"), [
    (dict(model="no_such_pkg.nets:f"), "--model no_such_pkg.nets: No module named 'no_such_pkg'"),
    (dict(model=f"{U}:missing"), "has no attribute 'missing'"),
    (dict(model=f"{U}:NOT_CALLABLE"), "NOT_CALLABLE is a int, not a callable"),
    (dict(model=f"{U}:needs_width"), "psgd calls needs_width with no arguments, but it takes (width)"),
    (dict(model=f"{U}:not_a_module"), "must return an nn.Module, got a str"),
    (dict(model=f"{U}:with_batchnorm"), "the model has buffer '1.running_mean'"),
    (dict(dataset=f"{U}:three_things"), "must return (train, test), got a tuple of 3"),
    (dict(dataset=f"{U}:mismatched_lengths"), "x has 100 samples, y has 90"),
    (dict(dataset=f"{U}:make_model"), "must return (train, test), got a TinyNet"),
    (dict(model=f"{U}:wrong_width"), "on a batch of the training set failed: RuntimeError"),
    (dict(loss=f"{U}:not_scalar"), "the loss must be a floating-point scalar tensor, got a tensor of shape (2,)"),
    (dict(loss=f"{U}:make_model"), "psgd calls make_model (output, target)"),
    (dict(dataset=f"{U}:make_regression"), "--loss cross_entropy needs integer class targets"),
    (dict(loss="mse"), "ValueError: mse: the output's shape (2, 3) is not the target's (2,)"),
])
def test_a_bad_spec_is_one_line_naming_the_flag(kw, says):
    assert says in refusal(**kw)


def test_a_file_spec_that_fails_to_import_says_why(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import torch\nraise RuntimeError('no GPU in this file')\n")
    assert "importing it failed: RuntimeError: no GPU in this file" in refusal(model=f"{bad}:f")
    assert "no such file" in refusal(model=f"{tmp_path / 'absent.py'}:f")


def test_psgd_run_refuses_before_it_makes_a_folder_or_a_process(tmp_path):
    out = tmp_path / "run"
    done = psgd_main("run", "--model", f"{U}:with_batchnorm", "--dataset", f"{U}:make_data", "--steps", "2",
                     "--out", str(out))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]  # one line, no traceback
    assert "BatchNorm" in done.stderr and "persistent=False" in done.stderr
    assert not out.exists()
    assert "--model must be one of" in psgd_main("run", "--model", "mlpp").stderr


def test_flags_validate_a_spec_syntactically_and_loss_and_optimizer_names():
    for bad, says in ((dict(model=ModelConfig(model="mlpp")), "--model must be one of"),
                      (dict(model=ModelConfig(loss="hinge")), "--loss must be one of"),
                      (dict(optim=OptimConfig(optimizer="lamb")), "--optimizer must be one of")):
        with pytest.raises(ValueError, match=says):
            validate(RunConfig(**bad))


# -- what is accepted -----------------------------------------------------------------------------
def test_specs_resolve_by_module_and_by_file_with_dotted_attributes(tmp_path):
    f = tmp_path / "nets.py"
    f.write_text("from torch import nn\nclass Zoo:\n    @staticmethod\n    def small():\n"
                 "        return nn.Linear(6, 3)\n")
    model = models.build(ModelConfig(model=f"{f}:Zoo.small"), 0, 0, seed=1)
    again = models.build(ModelConfig(model=f"{f}:Zoo.small"), 0, 0, seed=1)
    assert torch.equal(model.weight, again.weight), "built under the run's seed: the same in every process"
    assert isinstance(models.build(ModelConfig(model=f"{U}:TinyNet"), 0, 0, seed=1), torch.nn.Module)


def test_user_data_as_tensors_or_a_dataset_gives_the_same_tensors_and_the_validation_split():
    a = data.load(DataConfig(dataset=f"{U}:make_data", val_fraction=0.25))
    b = data.load(DataConfig(dataset=f"{U}:make_dataset_objects", val_fraction=0.25))
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_val, b.y_val)
    assert (len(a.x_train), len(a.x_val), len(a.x_test), a.num_classes) == (384, 128, 128, 3)
    assert data.train_size(DataConfig(dataset=f"{U}:make_data", val_fraction=0.25)) == 384
    reg = data.load(DataConfig(dataset=f"{U}:make_regression"))
    assert reg.num_classes == 3 and reg.y_train.dtype == torch.float32  # outputs a built-in model needs


def test_the_loss_and_its_accuracy():
    x = torch.randn(5, 2, 4)
    y = torch.randint(0, 4, (5, 2))
    assert torch.equal(losses.cross_entropy(x, y), F.cross_entropy(x.reshape(-1, 4), y.reshape(-1)))
    model = torch.nn.Linear(6, 3)
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    ds = data.load(DataConfig(dataset=f"{U}:make_regression"))
    loss, acc = evaluate.evaluate(model, flat, ds.x_test, ds.y_test, f"{U}:half_mse")
    assert acc is None
    with torch.no_grad():
        assert loss == pytest.approx(float(((model(ds.x_test) - ds.y_test) ** 2).mean() / 2), rel=1e-6)
    _, acc = evaluate.evaluate(model, flat, ds.x_test, ds.y_test.argmax(1), "cross_entropy")
    assert 0 <= acc <= 1


def test_sources_record_each_file_hash_and_a_new_hash_is_a_new_cached_run(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from torch import nn\ndef make():\n    return nn.Linear(6, 3)\n")
    cfg = cfg_of(model=f"{f}:make")
    found = workload.sources(cfg)
    assert set(found) == {"--model", "--dataset"}
    assert found["--model"]["file"] == str(f) and len(found["--model"]["sha256"]) == 64
    assert found["--dataset"]["file"].endswith("tests/user_workload.py")
    before = run_digest(cfg, "v1")
    f.write_text("from torch import nn\ndef make():\n    return nn.Linear(6, 3, bias=False)\n")
    assert run_digest(cfg, "v1") != before, "the suite's cache keys on the file's content"
    assert workload.sources(RunConfig()) == {} and run_digest(RunConfig(), "v1") == run_digest(RunConfig(), "v1")


# -- runs -----------------------------------------------------------------------------------------
def reference(cfg: RunConfig, opt_cls, **opt_kw) -> torch.Tensor:
    """One process, a torch optimizer, the global batch of every step (the batch plan's)."""
    ds = data.load(cfg.data)
    model = models.build(cfg.model, ds.input_dim, ds.num_classes, cfg.seed)
    opt = opt_cls(model.parameters(), **opt_kw)
    plan = data.BatchPlan(ds.y_train, 1, cfg.global_batch, seed=cfg.seed)
    loss_fn = losses.get(cfg.model.loss)
    for step in range(cfg.steps):
        idx = plan.indices(0, step)
        opt.zero_grad()
        loss_fn(model(ds.x_train[idx]), ds.y_train[idx]).backward()
        opt.step()
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


@pytest.mark.parametrize("workers", [1, 3])
def test_sync_ps_on_your_model_equals_single_process_training_sgd_and_adamw(shards, workers):
    """N workers x batch b = one process at batch N x b, with torch.optim.SGD and torch.optim.AdamW
    (to float rounding: the shards' fused kernels, and N partial means summed)."""
    for opt, ref_cls, ref_kw in (
            (OptimConfig(lr=0.1, momentum=0.9, weight_decay=1e-3), torch.optim.SGD,
             dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
            (OptimConfig(optimizer="adamw", lr=3e-3, beta1=0.8, beta2=0.99, weight_decay=0.1), torch.optim.AdamW,
             dict(lr=3e-3, betas=(0.8, 0.99), weight_decay=0.1))):
        cfg = cfg_of(mode="sync", workers=workers, servers=2, batch_size=24 // workers, steps=12, seed=4, optim=opt)
        addresses, cores = shards(cfg)
        got = train_in_threads(cfg, addresses, cores)
        want = reference(cfg, ref_cls, **ref_kw)
        assert (got - want).abs().max() < 1e-5, opt.optimizer
        start = models.FlatParams(models.build(cfg.model, 0, 0, cfg.seed)).params
        assert (got - start).abs().max() > 1e-2


def in_process_runs(monkeypatch) -> None:
    """`psgd run` in this process (psgd_main) with the environment tests/helpers.py `psgd` gives its
    processes; the shards and workers are real processes, forked from this process's warm parent."""
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)


@pytest.mark.usefixtures("warm_runs")
def test_a_user_loss_trains_through_psgd_run_in_every_mode(tmp_path, monkeypatch):
    """--model / --dataset / --loss specs through real processes: PS (sync with local SGD, SSP) and
    all-reduce; accuracy is None for a regression loss; config.json records the specs' files."""
    in_process_runs(monkeypatch)
    common = ["--model", f"{U}:make_model", "--dataset", f"{U}:make_regression", "--loss", f"{U}:half_mse",
              "--workers", "2", "--steps", "20", "--batch-size", "16", "--lr", "0.05", "--eval-every", "0"]
    runs = {"ssp": ["--mode", "ssp", "--servers", "2", "--optimizer", "adamw", "--lr", "0.01"],
            "localsgd": ["--mode", "sync", "--local-steps", "4"],
            "allreduce": ["--mode", "allreduce", "--optimizer", "adamw", "--lr", "0.01"]}
    for name, extra in runs.items():
        out = tmp_path / name
        done = psgd_main("run", *common, *extra, "--out", str(out), "--quiet")
        assert done.returncode == 0, done.stderr[-2000:]
        s = summary(out)
        assert s["final_test_accuracy"] is None
        assert 0 < s["final_test_loss"] < 2.0, (name, s["final_test_loss"])
        recorded = json.loads((out / "config.json").read_text())
        assert recorded["sources"]["--loss"]["spec"] == f"{U}:half_mse"
        assert recorded["model"]["model"] == f"{U}:make_model"


@pytest.mark.usefixtures("warm_runs")
def test_psgd_summarize_reads_a_config_json_with_sources(tmp_path, monkeypatch):
    in_process_runs(monkeypatch)
    out = tmp_path / "run"
    done = psgd_main("run", "--model", f"{U}:make_model", "--dataset", f"{U}:make_dataset_objects", "--workers", "1",
                "--steps", "5", "--out", str(out), "--quiet")
    assert done.returncode == 0, done.stderr[-2000:]
    first = summary(out)
    again = psgd_main("summarize", str(out), "--quiet")
    assert again.returncode == 0, again.stderr
    assert summary(out)["final_test_loss"] == first["final_test_loss"]
    assert 0 <= first["final_test_accuracy"] <= 1


def test_a_persistent_buffer_is_refused_and_a_constant_one_is_not():
    with pytest.raises(userspec.SpecError, match="num_batches_tracked|running_mean"):
        models.check_trainable(torch.nn.BatchNorm1d(3), "x")
    models.check_trainable(torch.nn.BatchNorm1d(3, track_running_stats=False), "x")
    models.check_trainable(models.build(ModelConfig(model=f"{U}:make_model"), 0, 0, 0), "x")  # persistent=False
    with pytest.raises(userspec.SpecError, match="float32"):
        models.check_trainable(torch.nn.Linear(2, 2).double(), "x")
    assert dataclasses.replace(cfg_of(), seed=1).model.model == f"{U}:make_model"


def test_by_hand_server_and_worker_take_your_model_and_the_suite_takes_specs(tmp_path, monkeypatch):
    """`psgd server` never imports your model (it sizes the shard from the first Init); `psgd
    worker` builds it; a bad spec given to the worker is one line, exit 2. A suite TOML's keys take
    specs like the flags do."""
    import subprocess
    import sys

    from psgd.lab.settings import config_from_settings
    from tests.helpers import ENV

    in_process_runs(monkeypatch)  # summarize runs in this process
    out = tmp_path / "by-hand"
    flags = ["--mode", "async", "--workers", "1", "--num-shards", "1", "--steps", "6", "--out", str(out),
             "--model", f"{U}:make_model", "--dataset", f"{U}:make_data", "--batch-size", "8"]
    server = subprocess.Popen([sys.executable, "-m", "psgd", "server", *flags, "--shard", "0", "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        line = server.stdout.readline()
        assert line.startswith("READY "), server.stderr.read()
        address = line.split()[1]
        bad = psgd("worker", *flags, "--rank", "0", "--servers", address, "--model", f"{U}:needs_width")
        assert bad.returncode == 2 and "needs_width" in bad.stderr and "Traceback" not in bad.stderr
        good = psgd("worker", *flags, "--rank", "0", "--servers", address)
        assert good.returncode == 0, good.stderr[-2000:]
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    done = psgd_main("summarize", str(out), "--quiet")
    assert done.returncode == 0, done.stderr[-2000:]
    assert summary(out)["global_updates"] == 6
    cfg = config_from_settings({"model": f"{U}:make_model", "dataset": f"{U}:make_data", "loss": f"{U}:half_mse"},
                               "suite.toml")
    assert workload.specs(cfg) == {"--model": f"{U}:make_model", "--dataset": f"{U}:make_data",
                                   "--loss": f"{U}:half_mse"}
