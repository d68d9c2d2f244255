"""The model zoo and the flat-parameter view every exchange works on.

Contract:
- `build(cfg, input_dim, num_classes, seed)` returns a freshly initialised model; the same
  arguments give bit-identical parameters in every process (init is seeded), which is what lets
  `sync` PS reproduce single-process training.
  Models: `logreg`; `mlp` (2 hidden layers, width 128); `cnn` (a small 1-D CNN, for mnist1d);
  `wide_mlp` (3 hidden layers of `--width`, default 1024; --width 3500 gives about 25M
  parameters, the communication-bound case); `gpt` (psgd/train/gpt.py, for `--dataset text`:
  `--width` 128, `--layers` 2, `--heads` 4 by default, about 0.41M parameters).
- Your own model (`--model pkg.mod:make_model` or `FILE.py:make_model`, psgd/train/userspec.py):
  a callable of no required arguments returning an `nn.Module`, called under the same seed
  in every process. What psgd synchronises is the parameters, so a model is refused (one line
  naming it) if it holds a persistent buffer: BatchNorm's running statistics would drift apart
  on each worker and never reach the shards, and the evaluation after the run would use the
  initial ones. Use GroupNorm / LayerNorm, `BatchNorm(track_running_stats=False)`, or register
  a constant as `register_buffer(..., persistent=False)` (a causal mask): non-persistent buffers
  are taken as constants, built identically in every process. Parameters must be float32.
- `FlatParams(model)` moves all parameters and gradients into two flat fp32 buffers and makes
  every `p` / `p.grad` a view of them, so a pulled vector loads with one copy and the gradient
  is already flat after backward (the trick DDP calls gradient_as_bucket_view).
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from psgd.core.config import ModelConfig, is_spec
from psgd.train import userspec

_BUILD_LOCK = threading.Lock()  # init draws from torch's global RNG; threads must not interleave


def build(cfg: ModelConfig, input_dim: int, num_classes: int, seed: int) -> nn.Module:
    with _BUILD_LOCK:
        torch.manual_seed(seed)
        return _build(cfg, input_dim, num_classes)


def _build(cfg: ModelConfig, input_dim: int, num_classes: int) -> nn.Module:
    if is_spec(cfg.model):
        return user_model(cfg.model)
    if cfg.model == "logreg":
        return nn.Linear(input_dim, num_classes)
    if cfg.model == "mlp":
        w = cfg.width or 128
        return nn.Sequential(nn.Linear(input_dim, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                             nn.Linear(w, num_classes))
    if cfg.model == "wide_mlp":
        w = cfg.width or 1024
        return nn.Sequential(nn.Linear(input_dim, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                             nn.Linear(w, w), nn.ReLU(), nn.Linear(w, num_classes))
    if cfg.model == "cnn":
        return Conv1dNet(input_dim, num_classes, cfg.width or 32)
    if cfg.model == "gpt":  # input_dim: the context (tokens per sample); num_classes: the vocabulary
        from psgd.train.gpt import GPT  # noqa: PLC0415

        return GPT(num_classes, input_dim, cfg.width or 128, cfg.layers, cfg.heads)
    if cfg.model == "dlrm":  # input_dim: the click logs' field count, which names their vocabularies
        from psgd.train import dlrm  # noqa: PLC0415

        return dlrm.build(cfg, input_dim, num_classes)
    raise ValueError(f"unknown model {cfg.model!r}")


def user_model(spec: str) -> nn.Module:
    """Call the user's model builder and check what it returned (see the module docstring)."""
    fn = userspec.resolve(spec, "--model")
    try:
        model = fn()
    except Exception as e:  # noqa: BLE001 - the user's code: its error, in one line, is the message
        raise userspec.SpecError(f"--model {spec}: calling it failed: {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise userspec.SpecError(f"--model {spec} must return an nn.Module, got a {type(model).__name__}")
    check_trainable(model, f"--model {spec}")
    return model


def check_trainable(model: nn.Module, what: str) -> None:
    """SpecError unless psgd can synchronise `model` whole: float32 parameters, no persistent buffer."""
    params = list(model.named_parameters())
    if not params:
        raise userspec.SpecError(f"{what}: the model has no parameters to train")
    for name, p in params:
        if p.dtype != torch.float32:
            raise userspec.SpecError(f"{what}: parameter {name!r} is {p.dtype}; psgd trains float32 parameters")
    persistent = set(model.state_dict().keys()) - {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for name, _ in model.named_buffers():
        if name in persistent:
            raise userspec.SpecError(
                f"{what}: the model has buffer {name!r} (e.g. BatchNorm running statistics); psgd synchronises "
                "parameters only, so it would differ on every worker and be lost at evaluation: use GroupNorm / "
                "LayerNorm, BatchNorm(track_running_stats=False), or register a constant with persistent=False")


class Conv1dNet(nn.Module):
    """Three 1-D convolutions and a linear head, in the spirit of the MNIST-1D paper's CNN."""

    def __init__(self, length: int, num_classes: int, channels: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, channels, 5, padding=2), nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),
        )
        out_len = ((length + 1) // 2 + 1) // 2
        self.head = nn.Linear(channels * out_len, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.unsqueeze(1)).flatten(1))


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count(cfg: ModelConfig, input_dim: int, num_classes: int) -> int:
    """The model's parameter count without allocating it (built on torch's meta device)."""
    with torch.device("meta"), _NoNormalDraws():
        return num_params(_build(cfg, input_dim, num_classes))


class _NoNormalDraws(TorchFunctionMode):
    """`normal_` does nothing (a meta tensor has no values to draw). Why: on the meta device
    torch runs normal_ as a Python decomposition whose first call imports torch._dynamo, about a
    second of CPU in every shard that sizes a transformer (nn.Embedding and gpt.py draw normals);
    uniform_, what the other layers draw, has a meta kernel of its own."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.normal_, nn.init.normal_):
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


class FlatParams:
    """One flat buffer for all parameters (`.params`) and one for their gradients (`.grads`)."""

    def __init__(self, model: nn.Module) -> None:
        params = self.model_params = list(model.parameters())
        device = params[0].device
        n = sum(p.numel() for p in params)
        self.params = torch.empty(n, dtype=torch.float32, device=device)
        self.grads = torch.zeros(n, dtype=torch.float32, device=device)
        self.zeroed = True
        offset = 0
        for p in params:
            k = p.numel()
            self.params[offset:offset + k].copy_(p.data.reshape(-1))
            p.data = self.params[offset:offset + k].view_as(p)
            # Autograd accumulates into an existing .grad in place, so backward writes here.
            p.grad = self.grads[offset:offset + k].view_as(p)
            offset += k

    def rehome(self, params: torch.Tensor, grads: torch.Tensor) -> None:
        """Move both buffers into `params` and `grads` (flat, this length; e.g. memory a transport
        lends, psgd/ps/transfer.py `Wire.lend`): the values are copied, every parameter and its
        gradient become views of the new buffers. Before any optimizer holds the old ones."""
        params.copy_(self.params)
        grads.copy_(self.grads)
        offset = 0
        for p in self.model_params:
            k = p.numel()
            p.data = params[offset:offset + k].view_as(p)
            p.grad = grads[offset:offset + k].view_as(p)
            offset += k
        self.params, self.grads = params, grads

    def zero_grad(self) -> None:
        self.grads.zero_()
        self.zeroed = True  # until the next backward (the worker loop clears it): see `zero_grad_once`

    def zero_grad_once(self) -> None:
        """Zero the gradients unless nothing was accumulated since they last were (the PS exchange
        zeroes them while it waits for the shards' reply)."""
        if not self.zeroed:
            self.zero_grad()
