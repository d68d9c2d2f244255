"""`psgd node` under torchrun: ranks 0..K-1 serve, the rest train, the addresses go through
torchrun's store; one command runs the job, and a sync job ends with psgd's own parameters, bit for bit.

torchrun's c10d store asks the resolver for the name of every connection's address (a reverse-DNS
query for ::ffff:127.0.0.1, which /etc/hosts does not list; psgd/train/node.py), so the real
torchrun runs here in a network namespace of its own with only lo up (`unshare -rn`): there the
query finds no route and nothing leaves the machine. Where no such namespace can be made, that
one test is skipped and says why.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import uuid

import pytest
import torch

from psgd.cli import build_parser, config_from_args
from psgd.core.errors import UsageError
from psgd.train import node
from tests.helpers import ENV, processes_with_env, psgd_main, summary, train_in_threads

TINY = ["--model", "mlp", "--dataset", "synthetic", "--num-samples", "600", "--batch-size", "16", "--threads", "1"]
TORCHRUN = "PSGD_TEST_TORCHRUN"  # marks every process one torchrun test started (orphan check)


def test_ranks_below_k_serve_and_the_rest_train():
    assert [node.role(r, 2) for r in range(5)] == [node.Role("shard", 0), node.Role("shard", 1), node.Role("worker", 0),
                                                   node.Role("worker", 1), node.Role("worker", 2)]
    assert node.workers_of(5, 2, None) == 3 and node.workers_of(5, 2, 3) == 3
    with pytest.raises(UsageError, match="WORLD_SIZE is 5, but --servers 2 \\+ --workers 2 = 4"):
        node.workers_of(5, 2, 2)
    with pytest.raises(UsageError, match="WORLD_SIZE 2 leaves no worker beside --servers 2"):
        node.workers_of(2, 2, None)
    assert node.address("127.0.0.1", 5) == "127.0.0.1:5" and node.address("fd00::2", 5) == "[fd00::2]:5"


def test_torchrun_variables_are_read_and_checked():
    env = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert node.from_environ(env) == node.TorchrunEnv(2, 3, "127.0.0.1", 29500, 0)
    assert node.from_environ(dict(env, TORCHELASTIC_RESTART_COUNT="1")).attempt == 1
    with pytest.raises(UsageError, match="not under torchrun"):
        node.from_environ({})
    with pytest.raises(UsageError, match="MASTER_PORT not set"):
        node.from_environ(dict(env, MASTER_PORT=""))
    with pytest.raises(UsageError, match="RANK 3 is not in 0..WORLD_SIZE-1 = 0..2"):
        node.from_environ(dict(env, RANK="3"))


def test_workers_wait_for_every_shard_then_read_them_in_order():
    """The store's part, on an in-memory store: a shard missing past the timeout is named."""
    import torch.distributed as dist

    store = dist.PrefixStore("psgd/attempt-0/", dist.HashStore())
    node.publish(store, 1, "127.0.0.1:7001")
    with pytest.raises(node.NodeError, match=r"no address from shard 0 \(of 2\) within 0.01s"):
        node.wait_for_shards(store, 2, 0.01)
    node.publish(store, 0, "127.0.0.1:7000")
    assert node.wait_for_shards(store, 2, 0.01) == ["127.0.0.1:7000", "127.0.0.1:7001"]


@pytest.mark.parametrize("env,args,message", [
    ({}, [], "not under torchrun"),
    ({"WORLD_SIZE": "4"}, ["--servers", "1", "--workers", "2"], "WORLD_SIZE is 4, but --servers 1 + --workers 2 = 3"),
    ({"WORLD_SIZE": "1"}, ["--servers", "1"], "WORLD_SIZE 1 leaves no worker"),
    ({}, ["--mode", "allreduce"], "--mode allreduce has no shards"),
    ({}, ["--bind", "0.0.0.0"], "--bind 0.0.0.0 listens on every address: give --advertise"),
    ({}, ["--shards-timeout", "0"], "--shards-timeout must be > 0"),
])
def test_usage_errors_are_one_line_exit_2(monkeypatch, env, args, message):
    torchrun = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"} if env or args else {}
    for name in (*node.NEEDED, "TORCH_CPP_LOG_LEVEL"):  # psgd node sets the last one: undone after the test
        monkeypatch.delenv(name, raising=False)
    for name, value in {**torchrun, **env}.items():
        monkeypatch.setenv(name, value)
    r = psgd_main("node", *args, *TINY)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def netns_prefix() -> list[str] | None:
    """argv that runs a command in a new network namespace with only lo up, or None here."""
    if not (shutil.which("unshare") and shutil.which("ip")):
        return None
    probe = subprocess.run(["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        return None
    return ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]


def test_torchrun_starts_a_1_server_2_worker_sync_job_that_equals_psgd(tmp_path, shards):
    prefix = netns_prefix()
    if prefix is None:
        pytest.skip("needs a network namespace (unshare -rn, ip): torchrun's store sends reverse-DNS queries")
    out = tmp_path / "node"
    flags = ["--mode", "sync", "--steps", "4", *TINY]
    marker = uuid.uuid4().hex
    # Port 0: torchrun's node 0 hosts the rendezvous store on a free port (one node needs no fixed
    # one); --local-addr 127.0.0.1: MASTER_ADDR is that address, not this host's looked-up name.
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                             "--nproc-per-node", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                             "--local-addr", "127.0.0.1", "-m", "psgd", "node", "--servers", "1", *flags,
                             "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(ENV, **{TORCHRUN: marker}))
    try:
        # Meanwhile, the same job in this process (threads against in-process shards, as
        # tests/test_equivalence.py runs it), while torchrun's processes load.
        cfg = config_from_args(build_parser().parse_args(["run", "--workers", "2", "--servers", "1", *flags]))
        addresses, cores = shards(cfg)
        expected = train_in_threads(cfg, addresses, cores)
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:  # torchrun stops its workers on SIGTERM
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    assert proc.returncode == 0, output
    assert not processes_with_env(TORCHRUN, marker)
    assert "psgd summarize" in output  # shard 0 says what comes next

    r = psgd_main("summarize", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert (s["mode"], s["workers"], s["servers"], s["global_updates"]) == ("sync", 2, 1, 4)
    # Bit for bit: the same code on the same batches, and two gradients sum the same in either order.
    assert torch.equal(torch.load(out / "final_params.pt"), expected)


SLURM = {"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "4711",
         "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_ID": "0"}


def test_srun_without_torchrun_takes_the_role_from_slurms_variables():
    """As PyTorch Lightning's SLURMEnvironment and submitit read them; tests/test_slurm.py runs it."""
    assert node.from_environ(SLURM) == node.TorchrunEnv(2, 3, "n1", 15000 + 4711, 0, launcher="srun", local_rank=0)
    given = node.from_environ(dict(SLURM, MASTER_ADDR="127.0.0.1", MASTER_PORT="29400", SLURM_RESTART_COUNT="1"))
    assert (given.master_addr, given.master_port, given.attempt) == ("127.0.0.1", 29400, 1)
    # torchrun under srun: torchrun's variables win
    torchrun = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert node.from_environ({**SLURM, **torchrun}) == node.TorchrunEnv(1, 4, "127.0.0.1", 29500, 0)
    with pytest.raises(UsageError, match="not in a job step"):  # the batch script itself
        node.from_environ({k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"})
    with pytest.raises(UsageError, match="SLURM_JOB_NODELIST not set"):
        node.from_environ(dict(SLURM, SLURM_JOB_NODELIST=""))
    with pytest.raises(UsageError, match="SLURM_PROCID 3 is not in 0..SLURM_NTASKS-1 = 0..2"):
        node.from_environ(dict(SLURM, SLURM_PROCID="3"))
    with pytest.raises(UsageError, match="not a number"):
        node.from_environ(dict(SLURM, SLURM_NTASKS="three"))
    assert node.default_port("123456") == 18456 and node.default_port("77_3") == 15773


def test_slurm_node_lists_expand_as_scontrol_show_hostnames():
    assert node.expand_nodelist("n[1-2]") == ["n1", "n2"]
    assert node.expand_nodelist("gpu[001-003,010],cpu-a") == ["gpu001", "gpu002", "gpu003", "gpu010", "cpu-a"]
    assert node.expand_nodelist("r[1-2]n[7-8]") == ["r1n7", "r1n8", "r2n7", "r2n8"]
    with pytest.raises(UsageError, match="bad range"):
        node.expand_nodelist("n[a-b]")

