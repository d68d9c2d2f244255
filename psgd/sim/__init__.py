"""The simulated cluster (`psgd run ... --simulate`): N virtual workers and K production shards in one
process on a virtual clock. Read in this order: timemodel.py (what time is made of), events.py (the
clock and its queues), workers.py (the workers over one model), cluster.py (the shards' side and
a step's messages), run.py (the run folder), calibrate.py (what is measured here), flags.py."""
