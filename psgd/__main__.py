"""`python -m psgd ...` is the same as the `psgd` console script (torchrun uses this form)."""

from psgd.cli import main

raise SystemExit(main())
