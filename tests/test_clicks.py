"""--dataset clicks (psgd/train/clicks.py): seeded, Zipf ids, a teacher's labels, the splits."""

import numpy as np
import pytest
import torch

from psgd.core.config import DataConfig
from psgd.train import clicks, data


def test_the_logs_are_a_pure_function_of_profile_count_and_seed():
    p = clicks.PROFILES["clicks"]
    a, b = clicks.generate(p, 2000, 7), clicks.generate(p, 2000, 7)
    assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y) and np.array_equal(a.p, b.p)
    c = clicks.generate(p, 2000, 8)
    assert not np.array_equal(a.x, c.x)
    # More samples extend the same logs: the ids' stream and the teacher do not move.
    longer = clicks.generate(p, 3000, 7)
    assert np.array_equal(longer.x[:2000], a.x) and np.array_equal(longer.p[:2000], a.p)


@pytest.mark.parametrize("name", list(clicks.PROFILES))
def test_ids_stay_in_each_fields_vocabulary(name):
    p = clicks.PROFILES[name]
    logs = clicks.generate(p, 500, 1)
    assert logs.x.dtype == np.int64 and logs.x.shape == (500, p.fields)
    assert (logs.x >= 0).all() and (logs.x < np.array(p.vocab)).all()
    assert set(np.unique(logs.y)) <= {0, 1}
    assert clicks.profile_for_fields(p.fields) is p  # a model sized by the field count finds its profile


def test_the_profiles_span_small_to_about_a_million_ids():
    assert clicks.PROFILES["clicks"].ids < 2000
    assert 0.9e6 < clicks.PROFILES["clicks-large"].ids < 1.1e6
    assert len({p.fields for p in clicks.PROFILES.values()}) == len(clicks.PROFILES)
    with pytest.raises(ValueError, match="no click-log profile has 9 fields"):
        clicks.profile_for_fields(9)


def test_ids_follow_the_stated_zipf_exponent():
    """The log-log slope of frequency against rank, fitted over the head, is -s."""
    rng = np.random.default_rng(0)
    s, vocab = 1.1, 1000
    ids = clicks.draw_ids(rng, vocab, s, 400_000)
    freq = np.bincount(ids, minlength=vocab)[:50] / len(ids)
    slope = np.polyfit(np.log(np.arange(1, 51)), np.log(freq), 1)[0]
    assert slope == pytest.approx(-s, abs=0.05)
    assert np.allclose(freq[:5], clicks.zipf_probabilities(vocab, s)[:5], rtol=0.03)
    assert freq[0] > freq[1] > freq[2]  # id 0 is the hottest


def test_the_teacher_sets_the_click_rate_and_is_better_than_chance_but_not_perfect():
    logs = clicks.generate(clicks.PROFILES["clicks"], 20_000, 42)
    assert logs.y.mean() == pytest.approx(0.3, abs=0.03)
    assert 0.7 < clicks.teacher_auc(logs) < 0.98


def test_auc_counts_pairs_ranked_right_ties_half():
    scores, labels = np.array([0.1, 0.4, 0.35, 0.8, 0.4]), np.array([0, 0, 1, 1, 1])
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = [1.0 if sp > sn else 0.5 if sp == sn else 0.0 for sp in pos for sn in neg]
    assert clicks.auc(scores, labels) == pytest.approx(sum(pairs) / len(pairs))
    assert clicks.auc(np.arange(4.0), np.array([0, 0, 1, 1])) == 1.0
    assert np.isnan(clicks.auc(np.arange(3.0), np.ones(3)))


def test_dataset_clicks_splits_train_validation_test():
    cfg = DataConfig(dataset="clicks", num_samples=1000, val_fraction=0.1)
    ds = data.load(cfg)
    assert ds.x_train.dtype == torch.int64 and ds.num_classes == 2 and ds.input_dim == 8
    assert (len(ds.x_train), len(ds.x_val), len(ds.x_test)) == (720, 80, 200)
    assert data.train_size(cfg) == 720
    assert data.SHAPES["clicks"] == (ds.input_dim, ds.num_classes)
    logs = clicks.generate(clicks.PROFILES["clicks"], 1000, 42)  # --data-seed's default
    assert torch.equal(ds.x_test, torch.from_numpy(logs.x[800:]))
    medium = data.load(DataConfig(dataset="clicks-medium", num_samples=100))
    assert data.SHAPES["clicks-medium"] == (medium.input_dim, medium.num_classes)
