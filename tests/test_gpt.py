"""The transformer workload: `--model gpt --dataset text` (psgd/train/gpt.py, psgd/train/text.py)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from psgd.core.config import DataConfig, ModelConfig
from psgd.train import data, losses, models, text
from tests.helpers import psgd_main, summary

# The runs this file makes in this process fork from one warm parent (tests/warm.py).
pytestmark = pytest.mark.usefixtures("warm_runs")


def test_the_corpus_is_pinned_and_split_by_position_into_next_character_windows():
    ds = data.load(DataConfig(dataset="text"))
    assert ds.num_classes == text.VOCAB and ds.x_train.shape[1] == text.BLOCK == data.SHAPES["text"][0]
    assert ds.x_train.dtype == torch.int64 and torch.equal(ds.x_train[0, 1:], ds.y_train[0, :-1])
    n = len(ds.x_train) + len(ds.x_val) + len(ds.x_test)
    assert abs(len(ds.x_train) / n - text.TRAIN) < 0.01 and len(ds.x_val) > 0 and len(ds.x_test) > 0
    assert 3.0 < text.unigram_loss() < math.log(text.VOCAB)  # below uniform: characters are not equally likely


def test_the_gpt_is_causal_weight_tied_and_made_of_parameters_only():
    model = models.build(ModelConfig(model="gpt", width=32, layers=2, heads=4), text.BLOCK, text.VOCAB, seed=0)
    models.check_trainable(model, "gpt")  # no persistent buffer
    assert model.head.weight is model.tok.weight
    assert models.num_params(model) == models.count(ModelConfig(model="gpt", width=32), *data.SHAPES["text"])
    x = torch.randint(0, text.VOCAB, (2, 16))
    out = model(x)
    assert out.shape == (2, 16, text.VOCAB)
    changed = x.clone()
    changed[:, 10] = (changed[:, 10] + 1) % text.VOCAB
    later = model(changed)
    assert torch.equal(out[:, :10], later[:, :10]), "a position must not see the future"
    assert not torch.equal(out[:, 10:], later[:, 10:])
    assert losses.cross_entropy(out, x).shape == ()


def test_a_shard_sizes_the_transformer_without_drawing_on_the_meta_device():
    """models.count builds on the meta device; normal_ there would import torch._dynamo (about a second
    of every transformer shard's start-up). A fresh interpreter, since another test may have loaded it."""
    code = ("import sys\nfrom psgd.core.config import ModelConfig\nfrom psgd.train import data, models\n"
            "n = models.count(ModelConfig(model='gpt', width=32), *data.SHAPES['text'])\n"
            "print(n, 'torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    model = models.build(ModelConfig(model="gpt", width=32), *data.SHAPES["text"], seed=0)
    assert done.stdout.split() == [str(models.num_params(model)), "False"]


def test_a_short_adamw_run_beats_the_unigram_baseline_through_the_parameter_server(tmp_path):
    out = tmp_path / "gpt"
    r = psgd_main("run", "--model", "gpt", "--width", "64", "--dataset", "text", "--mode", "sync", "--workers", "2",
                  "--optimizer", "adamw", "--lr", "1e-2", "--batch-size", "16", "--steps", "100", "--eval-every", "0",
                  "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert s["final_test_loss"] < text.unigram_loss() - 0.3, s["final_test_loss"]  # measured: 2.72 against 3.24
    assert s["final_val_loss"] is not None and 0 < s["final_test_accuracy"] < 1
