"""--overlap: same weights as the plain exchange, pushes leave during backward, pulls stream in per range."""


import pytest
import torch

from psgd.core.config import DataConfig, ModelConfig, OptimConfig, RunConfig
from psgd.ps.client import make_client
from psgd.train import assemble, data, models
from tests.helpers import processes_mentioning, psgd_main, summary, train_in_threads
from tests.test_equivalence import run_plain_torch

# The runs this file makes in this process fork from one warm parent (tests/warm.py).
pytestmark = pytest.mark.usefixtures("warm_runs")

STEPS = 25
MODEL = ModelConfig(model="mlp", width=32)
DATA = DataConfig(dataset="synthetic", num_samples=2000)
OPTIM = OptimConfig(lr=0.1, momentum=0.9, weight_decay=1e-3)


def run_ps(shards, workers: int, batch: int, servers: int, overlap: bool, accumulate: int = 1,
           transport: str = "grpc") -> torch.Tensor:
    cfg = RunConfig(mode="sync", workers=workers, servers=servers, batch_size=batch, steps=STEPS, seed=3,
                    optim=OPTIM, data=DATA, model=MODEL, device="cpu", overlap=overlap, accumulate=accumulate,
                    transport=transport)
    addresses, cores = shards(cfg)
    return train_in_threads(cfg, addresses, cores)


@pytest.mark.parametrize("servers,accumulate,transport", [(1, 1, "grpc"), (3, 1, "grpc"), (3, 2, "grpc"),
                                                       (3, 1, "tcp")])
def test_overlap_gives_the_same_weights_as_plain_training(shards, servers, accumulate, transport):
    overlapped = run_ps(shards, workers=2, batch=16 // accumulate, servers=servers, overlap=True,
                        accumulate=accumulate, transport=transport)
    assert (overlapped - run_plain_torch(32)).abs().max() < 1e-5


def _one_step(shards, num_shards: int):
    """One overlapped step of a 3-layer MLP against real shards; returns (events, exchange, flat)."""
    ds = data.load(DATA)
    model = models.build(ModelConfig(model="wide_mlp", width=64), ds.input_dim, ds.num_classes, seed=0)
    flat = models.FlatParams(model)
    cfg = RunConfig(mode="async", workers=1, servers=num_shards, overlap=True)
    addresses, cores = shards(cfg)
    ex = assemble.ps_exchange(cfg, addresses)
    ex.setup(flat, 0)
    ex.watch(model, flat)
    events = []
    start_push = ex.client.start_push

    def spy(k, clock, grad):
        events.append(f"push {k}")
        return start_push(k, clock, grad)

    ex.client.start_push = spy
    first = model[0].weight  # its gradient is the last one backward produces
    first.register_post_accumulate_grad_hook(lambda p: events.append("first layer grad"))
    before = ex.before_compute(0, flat)
    flat.zero_grad()
    torch.nn.functional.cross_entropy(model(ds.x_train[:16]), ds.y_train[:16]).backward()
    events.append("backward done")
    after = ex.after_compute(0, flat)
    return events, ex, flat, cores, before, after


def test_last_shard_is_pushed_during_backward(shards):
    events, ex, flat, cores, before, after = _one_step(shards, num_shards=4)
    ex.close()
    assert not before.done and not after.done and after.counted
    # The last shard (last layers) leaves before backward reaches the first layer.
    assert events.index("push 3") < events.index("first layer grad") < events.index("backward done")
    assert sorted(e for e in events if e.startswith("push")) == ["push 0", "push 1", "push 2", "push 3"]
    assert all(s.policy.version == 1 for s in cores)
    assert after.bytes_pushed == after.bytes_pulled == 4 * flat.params.numel()


def test_pulled_ranges_are_complete_when_waited_for(shards):
    cfg = RunConfig(mode="async", workers=1, servers=2)
    addresses, _ = shards(cfg)
    n = 700_000  # several chunks per shard
    values = torch.linspace(-1, 1, n)
    client = make_client("grpc", addresses, 0, n)
    try:
        client.init(values)
        out = torch.zeros(n)
        streams = client.start_pull(0, out)
        assert [h.version for h in streams.wait_headers()] == [0, 0]
        streams.wait_range(0, 10)
        assert torch.equal(out[:10], values[:10])
        streams.wait_range(n - 10, n)
        assert torch.equal(out[-10:], values[-10:])
        result = streams.result()
        assert torch.equal(out, values) and result.bytes == 4 * n and not result.done
    finally:
        client.close()


def test_run_with_overlap_and_link(tmp_path):
    out = tmp_path / "overlap"
    r = psgd_main("run", "--mode", "sync", "--workers", "2", "--servers", "2", "--steps", "8", "--overlap",
                  "--link", "1gbit,100us", "--dataset", "synthetic", "--num-samples", "1000", "--model", "mlp",
                  "--out", str(out))
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert s["global_updates"] == 8 and s["config"]["overlap"] is True
    assert s["bytes_pushed"] == s["bytes_pulled"] == 16 * 4 * s["params"]
    assert processes_mentioning(str(out)) == []
