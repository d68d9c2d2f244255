"""psgd/train/rowserve.py: a process serving one shard's rows, from the same seeded model the workers build."""

import subprocess
import sys

import torch

from psgd.core import rows
from psgd.core.config import ModelConfig
from psgd.ps.rows_tcp import RowClient
from psgd.train import data, dlrm, models

from .helpers import ENV


def test_a_row_server_serves_its_shard_of_the_seeded_tables_until_its_stdin_closes():
    p = subprocess.Popen([sys.executable, "-m", "psgd.train.rowserve", "--dataset", "clicks", "--width", "4",
                          "--shard", "1", "--shards", "2", "--scheme", "range"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        word, port = p.stdout.readline().split()
        assert word == "port"
        c = RowClient(f"127.0.0.1:{port}")
        model = models.build(ModelConfig(model="dlrm", width=4), *data.SHAPES["clicks"], seed=0)
        tables = [m.weight.detach() for _, m in dlrm.embedding_tables(model)]
        assert c.dims == [4] * len(tables)
        part = rows.RowPartition(tables[0].shape[0], 2, "range")
        ids = part.owned(1)[:5]
        assert torch.equal(c.pull(0, [(0, ids)])[0], tables[0][ids])
        assert [s["rows"] for s in c.stats()] == [rows.RowPartition(len(t), 2, "range").share()[1] for t in tables]
        c.close()
    finally:
        p.stdin.close()
    assert p.wait(timeout=60) == 0


def test_usage_errors_exit_2_in_one_line():
    r = subprocess.run([sys.executable, "-m", "psgd.train.rowserve", "--shard", "2", "--shards", "2"],
                       capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--shard" in r.stderr
