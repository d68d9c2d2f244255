"""How the all-reduce ranks find each other: the rendezvous, the backend, `psgd run`'s local group.

- `Rendezvous.from_env(rank, workers, env, init_method)` reads the standard variables RANK,
  WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (env://), which torchrun sets;
  tcp://HOST:PORT and file://PATH (what `psgd run` uses) also work. Anything that does not fit is
  a UsageError (exit 2) before any process waits for another.
- `choose_backend(requested, device, local_world_size, cuda_devices)` (pure): nccl when each rank
  on a host has its own CUDA device, gloo otherwise; `--backend` overrides, and nccl without one
  GPU per rank is a UsageError naming the fix. `usable_cuda_devices()`: what torch sees for NCCL.
- `launch_args(backend, device, workers, out, env)`: for `psgd run`, the extra worker flags and
  the environment of a local group, as torchrun would set them, with a file rendezvous in the run
  folder; `free_port()` a port free on 127.0.0.1 now.
psgd/allreduce/collective.py (`CollectiveExchange`) joins the group these describe, and re-exports them.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from psgd.core.devices import parse_device
from psgd.core.errors import UsageError


@dataclass(frozen=True)
class Rendezvous:
    """Where this process sits in the group, and how the group finds itself."""
    rank: int                    # global rank 0..world_size-1 ($RANK or --rank)
    world_size: int              # ranks in the group ($WORLD_SIZE), always equal to --workers
    local_rank: int              # rank on this host ($LOCAL_RANK): nccl uses cuda:LOCAL_RANK
    local_world_size: int        # ranks on this host ($LOCAL_WORLD_SIZE): GPUs nccl needs here
    init_method: str = "env://"  # env:// reads MASTER_ADDR / MASTER_PORT (and torchrun's agent store)

    @classmethod
    def from_env(cls, rank: int, workers: int, env: Mapping[str, str], init_method: str = "env://") -> Rendezvous:
        """Read the standard variables (what torchrun sets); UsageError if they do not fit.

        `init_method` file://PATH (what `psgd run` uses) needs no MASTER_ADDR / MASTER_PORT: a
        shared file is the whole rendezvous, and no TCP store makes reverse-DNS queries."""
        def number(name: str, default: int) -> int:
            text = env.get(name)
            if text is None or text == "":
                return default
            if not text.isdigit():
                raise UsageError(f"${name} must be a number, got {text!r}")
            return int(text)

        world = number("WORLD_SIZE", workers)
        if world != workers:
            raise UsageError(f"WORLD_SIZE={world} but --workers {workers}: they must agree "
                             "(torchrun: --nnodes x --nproc-per-node = --workers)")
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not env.get(v)]
        if not init_method.startswith(("env://", "tcp://", "file://")):
            raise UsageError(f"--rendezvous must be env://, tcp://HOST:PORT or file://PATH, got {init_method!r}")
        if missing and init_method == "env://":
            raise UsageError(f"the all-reduce rendezvous needs ${' and $'.join(missing)} "
                             "(torchrun and psgd run set them; by hand: MASTER_ADDR=host0 MASTER_PORT=29500)")
        local_world = number("LOCAL_WORLD_SIZE", workers)
        local_rank = number("LOCAL_RANK", rank)
        if not 0 <= local_rank < local_world:
            raise UsageError(f"LOCAL_RANK={local_rank} must be in 0..{local_world - 1} (LOCAL_WORLD_SIZE)")
        return cls(rank, world, local_rank, local_world, init_method)


def usable_cuda_devices() -> int:
    """CUDA devices NCCL could use on this host (0 on a CPU-only build of torch)."""
    return torch.cuda.device_count() if torch.cuda.is_available() and dist.is_nccl_available() else 0


def choose_backend(requested: str, device: str, local_world_size: int, cuda_devices: int) -> str:
    """nccl when every rank on this host gets its own CUDA device, gloo otherwise (pure).

    NCCL needs one device per rank: two ranks on one GPU is unsupported and may hang, so asking
    for it without enough devices (or with `--device cuda:N`, one GPU for every rank of the host)
    is a usage error here, naming the fix, before any process waits for another.
    """
    kind, index = parse_device(device)
    shared = index is not None and local_world_size > 1  # cuda:N: every rank of the host on GPU N
    one_gpu_each = kind != "cpu" and cuda_devices >= local_world_size and not shared
    if requested == "nccl" and not one_gpu_each:
        if kind == "cpu":
            why, fix = "--device cpu was asked for", "use --device cuda (or auto)"
        elif shared:
            why, fix = (f"--device {device} puts all {local_world_size} ranks of this host on one GPU",
                        "use --device cuda (rank r takes cuda:LOCAL_RANK)")
        else:
            why = f"this host runs {local_world_size} ranks and torch sees {cuda_devices} CUDA device(s) for NCCL"
            fix = (f"run at most one rank per GPU (--workers {cuda_devices}, or torchrun --nproc-per-node "
                   f"{cuda_devices})" if cuda_devices else "run on a host with a GPU per rank")
        raise UsageError(f"--backend nccl needs one CUDA device per rank, but {why}: {fix}, or use --backend gloo "
                         "or auto (GPUs shared, gradients reduced through CPU buffers)")
    if requested == "auto":
        return "nccl" if one_gpu_each else "gloo"
    return requested


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the rendezvous store binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_args(backend: str, device: str, workers: int, out: str, env: dict) -> tuple[list[str], dict]:
    """For `psgd run`: the extra worker flags and the environment of a local group of `workers`
    ranks, as torchrun would set it (the launcher adds RANK and LOCAL_RANK per worker), with the
    rendezvous in the run folder `out`. Fails fast on a bad backend."""
    choose_backend(backend, device, workers, usable_cuda_devices())
    env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(workers),
               LOCAL_WORLD_SIZE=str(workers))
    # A file rendezvous in the run folder: local runs then make no TCP-store connection (whose
    # address lookups leave loopback as reverse-DNS queries). The file must not survive a run.
    store = Path(out).resolve() / "rendezvous"
    store.unlink(missing_ok=True)
    return ["--rendezvous", f"file://{store}"], env
