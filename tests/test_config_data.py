import gzip
import struct

import numpy as np
import pytest
import torch

from psgd import data
from psgd.cli import build_parser, config_from_args
from psgd.config import DataConfig, RunConfig, from_dict, to_argv, to_dict, validate, with_epochs_resolved


def test_argv_round_trip_rebuilds_the_config():
    cfg = RunConfig(mode="ssp", workers=3, servers=2, staleness=4, straggler=((0, 30), (2, 5)), jitter=2.5,
                    skip_nonfinite=True, fail_at=((1, 7),), data=DataConfig(dataset="mnist1d", shard_data="noniid"))
    args = build_parser().parse_args(["run", *to_argv(cfg)])
    assert config_from_args(args) == cfg
    assert from_dict(to_dict(cfg)) == cfg


def test_validation_and_epochs():
    with pytest.raises(ValueError, match="--batch-size"):
        validate(RunConfig(batch_size=0))
    cfg = with_epochs_resolved(RunConfig(epochs=2, workers=4, batch_size=10), train_size=1000)
    assert cfg.steps == 50
    with pytest.raises(ValueError, match="bogus"):
        from_dict({"bogus": 1})


def test_global_batches_split_across_workers():
    labels = torch.arange(200) % 10
    four = data.BatchPlan(labels, 4, 8, seed=1)
    one = data.BatchPlan(labels, 1, 32, seed=1)
    for step in (0, 5, 6, 13):  # 6 global batches per epoch: crosses epochs
        joined = torch.cat([four.indices(r, step) for r in range(4)])
        assert torch.equal(joined, one.indices(0, step))
    assert not torch.equal(one.indices(0, 0), one.indices(0, 6))  # a new permutation each epoch


def test_noniid_gives_each_worker_its_own_labels():
    labels = torch.arange(400) % 4
    plan = data.BatchPlan(labels, 4, 10, seed=0, noniid=True)
    for r in range(4):
        assert set(labels[plan.indices(r, 3)].tolist()) == {r}


def test_mnist1d_is_generated_offline_and_cached(tmp_path):
    cfg = DataConfig(dataset="mnist1d", num_samples=600, data_dir=str(tmp_path))
    ds = data.load(cfg)
    assert ds.x_train.shape == (480, 40) and ds.x_test.shape == (120, 40) and ds.num_classes == 10
    assert list(tmp_path.glob("mnist1d-*.npz"))
    assert torch.equal(data.load(cfg).x_train, ds.x_train)
    assert data.train_size(cfg) == 480


def test_mnist_idx_files(tmp_path):
    def write(name, arr):
        header = struct.pack(">HBB", 0, 8, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
        with gzip.open(tmp_path / (name + ".gz"), "wb") as f:
            f.write(header + arr.astype(np.uint8).tobytes())

    rng = np.random.default_rng(0)
    write("train-images-idx3-ubyte", rng.integers(0, 255, (20, 28, 28)))
    write("train-labels-idx1-ubyte", rng.integers(0, 10, 20))
    write("t10k-images-idx3-ubyte", rng.integers(0, 255, (5, 28, 28)))
    write("t10k-labels-idx1-ubyte", rng.integers(0, 10, 5))
    ds = data.load(DataConfig(dataset="mnist", data_dir=str(tmp_path)))
    assert ds.x_train.shape == (20, 784) and float(ds.x_train.max()) <= 1.0 and ds.y_test.shape == (5,)
    with pytest.raises(FileNotFoundError, match="not found"):
        data.load(DataConfig(dataset="mnist", data_dir=str(tmp_path / "missing")))
