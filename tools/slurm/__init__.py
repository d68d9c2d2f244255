"""A throw-away Slurm cluster on this machine (tools/slurm/cluster.py) for `make slurm-check` and
tests/test_slurm.py."""
