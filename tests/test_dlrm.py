"""--model dlrm (psgd/train/dlrm.py): its shape, its loss is the logistic loss, its tables are
found (in a user's model too), and it learns the click logs through psgd run's dense path."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from psgd.core.config import DataConfig, ModelConfig
from psgd.train import clicks, data, dlrm, models

from .helpers import psgd_main, summary

pytestmark = pytest.mark.usefixtures("warm_runs")  # its runs fork from the tests' warm parent


def test_dlrm_has_a_table_per_field_and_answers_two_logits():
    p = clicks.PROFILES["clicks"]
    m = models.build(ModelConfig(model="dlrm", width=4), p.fields, 2, seed=0)
    assert [t.num_embeddings for t in m.tables] == list(p.vocab) and m.tables[0].embedding_dim == 4
    out = m(torch.zeros(3, p.fields, dtype=torch.int64))
    assert out.shape == (3, 2) and torch.equal(out[:, 0], torch.zeros(3))
    # Concatenation (F x d) and the F(F-1)/2 pairwise dots feed the top MLP.
    assert m.top[0].in_features == p.fields * 4 + p.fields * (p.fields - 1) // 2
    assert models.count(ModelConfig(model="dlrm", width=4), *data.SHAPES["clicks"]) == models.num_params(m)


def test_the_interaction_is_the_pairwise_dot_products():
    m = dlrm.DLRM((5, 6, 7), dim=3)
    x = torch.tensor([[1, 2, 3], [4, 5, 6]])
    e = [t(x[:, f]) for f, t in enumerate(m.tables)]
    want = torch.stack([(e[0] * e[1]).sum(1), (e[0] * e[2]).sum(1), (e[1] * e[2]).sum(1)], dim=1)
    z = m.top(torch.cat([torch.cat(e, dim=1), want], dim=1))
    assert torch.allclose(m(x)[:, 1:], z, atol=1e-6)


def test_cross_entropy_over_its_logits_is_the_logistic_loss():
    m = dlrm.DLRM((5, 6), dim=3)
    x, y = torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.tensor([1, 0, 1])
    out = m(x)
    assert torch.allclose(F.cross_entropy(out, y), F.binary_cross_entropy_with_logits(out[:, 1], y.float()),
                          atol=1e-6)


def test_dlrm_on_another_datasets_shape_is_refused_in_one_line():
    with pytest.raises(ValueError, match="sized by its click-log dataset: no click-log profile has 40 fields"):
        models.build(ModelConfig(model="dlrm"), 40, 2, seed=0)
    with pytest.raises(ValueError, match="predicts clicks"):
        models.build(ModelConfig(model="dlrm"), 8, 10, seed=0)


class UserRecommender(nn.Module):
    """A user's model: its embeddings among other layers, one of them shared."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 1)
        self.users = nn.Embedding(10, 4)
        self.items = nn.Embedding(20, 4)
        self.items_again = self.items  # shared: one table, counted once

    def forward(self, x):
        return self.head(self.users(x[:, 0]) * self.items_again(x[:, 1]))


def test_embedding_tables_are_found_in_any_model_in_parameter_order():
    m = UserRecommender()
    tables = dlrm.embedding_tables(m)
    assert [name for name, _ in tables] == ["users.weight", "items.weight"]
    assert [t for _, t in tables] == [m.users, m.items]
    assert dlrm.sparse_fraction(m) == pytest.approx(120 / 125)
    d = dlrm.DLRM(clicks.PROFILES["clicks"].vocab)
    assert len(dlrm.embedding_tables(d)) == 8 and 0.5 < dlrm.sparse_fraction(d) < 1


def test_dlrm_learns_the_clicks_above_chance_through_psgd_run(tmp_path):
    """The dense path as it is: 2 shards, 2 sync workers, every parameter pulled and pushed."""
    out = tmp_path / "dlrm"
    r = psgd_main("run", "--dataset", "clicks", "--model", "dlrm", "--mode", "sync", "--workers", "2",
                  "--servers", "2", "--epochs", "3", "--batch-size", "16", "--out", str(out))
    assert r.returncode == 0, r.stderr
    s = summary(out)
    ds = data.load(DataConfig(dataset="clicks"))
    majority = max(float(ds.y_test.float().mean()), 1 - float(ds.y_test.float().mean()))
    assert s["final_test_accuracy"] > majority + 0.03, (s["final_test_accuracy"], majority)
    # And ranks clicks well: AUC of the trained model on the test split, against chance (0.5).
    m = models.build(ModelConfig(model="dlrm"), ds.input_dim, ds.num_classes, seed=0)
    torch.nn.utils.vector_to_parameters(torch.load(out / "final_params.pt"), m.parameters())
    with torch.no_grad():
        score = m(ds.x_test)[:, 1].numpy()
    assert clicks.auc(score, ds.y_test.numpy()) > 0.7
    assert np.isfinite(s["final_test_loss"])
