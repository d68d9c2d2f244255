"""Analyses of the remedies: what the field does about each problem the suite shows, measured
beside that problem on the same model, data and seeds (backup workers against stragglers,
staleness-aware rates and DC-ASGD against stale gradients, sparsified pushes against the
central server's link). Same contract as psgd/lab/analyses.py, whose `analyse` dispatches here.
"""

from __future__ import annotations

ANALYSES: dict = {}
