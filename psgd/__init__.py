"""psgd: a parameter-server and all-reduce lab for data-parallel SGD.

See README.md for the two commands (`make test`, `make experiments`) and docs/architecture.md
for how the pieces fit together.
"""

__version__ = "0.1.0"
