"""05 - all-reduce: no parameter server; the workers average their gradients among themselves.

Four workers train the same MLP twice: with torch.distributed's all-reduce, then with the
hand-written ring (psgd/allreduce/ring.py). Both reach the same parameters (to float rounding), every
replica stays identical (summary.json: replicas_consistent), and each worker sends
2(N-1)/N x the model per step, 1.5 x for N = 4, where a PS worker pushes 1 x and pulls 1 x.

    python examples/06_allreduce.py

The same from the shell, and under torchrun (one host or several):
    psgd run --mode allreduce --workers 4 --model mlp --dataset mnist1d --steps 100
    psgd run --mode allreduce --allreduce-impl ring --workers 4 --model mlp --dataset mnist1d --steps 100
    torchrun --nproc-per-node 4 --master-addr 127.0.0.1 -m psgd worker --mode allreduce --workers 4 ...
"""

import dataclasses
import tempfile

import torch

from psgd.core.config import DataConfig, ModelConfig, RunConfig
from psgd.train import launch


def main() -> None:
    base = RunConfig(mode="allreduce", workers=4, steps=30, device="cpu", model=ModelConfig("mlp"),
                     data=DataConfig(dataset="mnist1d", num_samples=4000))
    finals = {}
    with tempfile.TemporaryDirectory() as tmp:
        for impl in ("library", "ring"):
            cfg = dataclasses.replace(base, allreduce_impl=impl, out=f"{tmp}/{impl}")
            s = launch.run(cfg)
            finals[impl] = torch.load(f"{tmp}/{impl}/final_params.pt")
            model_mb = 4 * s["params"] / 1e6
            sent_mb = s["bytes_sent"]["0"] / s["global_updates"] / 1e6
            assert s["replicas_consistent"], "every replica must hold the same parameters after every step"
            print(f"{impl:8s} test accuracy {s['final_test_accuracy']:.3f}, {s['updates_per_s']:6.1f} updates/s, "
                  f"replicas identical: {s['replicas_consistent']}, sent per worker and step {sent_mb:.3f} MB "
                  f"= {sent_mb / model_mb:.2f} x the model")
    gap = float((finals["library"] - finals["ring"]).abs().max())
    print(f"largest difference library vs ring: {gap:.1e}")
    assert gap < 1e-4, "the hand-written ring must compute the library's all-reduce (to float rounding)"


if __name__ == "__main__":
    main()
