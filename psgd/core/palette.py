"""The one palette of every psgd figure (Okabe & Ito 2008, colour-blind safe): pure data.

A colour per mode (`MODE_COLORS`) that nothing else uses; anything that is not a mode (dtype,
skew, batch, link, bandwidth) takes `VARIANT_COLORS`, and the parts of a step (wait, pull,
compute, push) take `SEGMENT_COLORS`, drawn from the same variant colours. Every line has a
marker. It sits in the core, below both the lab's figures (psgd/lab/plots.py, trace.py) and the
benchmarks' (psgd/bench/), so that neither imports the other for a colour.
"""

from __future__ import annotations

MODE_COLORS = {"sync": "#0072B2", "async": "#D55E00", "ssp": "#009E73", "allreduce": "#CC79A7",
               "ps": "#0072B2", "ring": "#CC79A7", "library": "#E69F00", "local": "#882255"}
MODE_MARKERS = {"sync": "o", "async": "s", "ssp": "^", "allreduce": "x", "ps": "o", "ring": "x", "library": "D",
                "local": "v"}
# For anything that is not a mode: greys, a brown, a sky blue and yellow, none of them a mode's colour.
VARIANT_COLORS = ["#000000", "#8C6D31", "#56B4E9", "#999999", "#F0E442", "#5A5A5A"]
VARIANT_MARKERS = ["o", "s", "^", "D", "v", "P"]
REF_COLOR = "#777777"
# The parts of a worker's step, listed in loop order (psgd/train/worker.py; `psgd trace` and `psgd plot
# --view time` take the order from here): variant colours (no mode's), waiting in grey: it is idle time.
SEGMENT_COLORS = {"wait": "#999999", "pull": "#8C6D31", "compute": "#56B4E9", "push": "#F0E442"}
LINESTYLES = ["-", "--", ":", "-."]


def color(mode: str, variant: int = -1) -> str:
    if variant >= 0:
        return VARIANT_COLORS[variant % len(VARIANT_COLORS)]
    return MODE_COLORS.get(mode, REF_COLOR)


def marker(mode: str, variant: int = -1) -> str:
    if variant >= 0:
        return VARIANT_MARKERS[variant % len(VARIANT_MARKERS)]
    return MODE_MARKERS.get(mode, "o")
