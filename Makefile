# psgd: `make test` and `make experiments` work on a fresh clone (they set themselves up).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Installed only when torch is not importable yet; GPU users keep theirs (or set TORCH_SPEC).
# pip takes it from its configured indexes; TORCH_INDEX adds one, e.g. PyTorch's CPU-only index
# https://download.pytorch.org/whl/cpu where plain PyPI would pull the multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.psgd-installed

.PHONY: install test test-fast experiments experiments-full experiments-transformer experiments-papers experiments-scale experiments-sparse \
	experiments-reference readme proto \
	lint gpu-check clean

install: $(STAMP)

PIP = $(BIN)/python -m pip
INDEX = $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
# psgd's own requirements, the dev and notebook extras' and the build's (setuptools), torch aside (read
# from pyproject.toml). The notebook extra (nbformat, nbclient, ipykernel: 12 small packages) is for
# tests/test_notebook.py, which runs the tutorial as a notebook: a test skipped by default is no test.
NOT_TORCH = $(BIN)/python -c 'import re, tomllib; t = tomllib.load(open("pyproject.toml", "rb")); p = t["project"]; \
	print(*(r for r in p["dependencies"] + p["optional-dependencies"]["dev"] + p["optional-dependencies"]["notebook"] + t["build-system"]["requires"] \
	        if re.match(r"[\w.-]+", r)[0] != "torch"))'

# The venv runs the pip of the Python that makes it (one of pip 22 or later; else ensurepip's), and
# installs torch's wheel beside the rest: both are mostly unzipping and compiling, one core each
# (`make install` on a fresh clone, 2 cores, side by side: 23 s against 42 s one after the other).
# The torch install takes torch alone (--no-deps), so the two never write the same package; the next
# install resolves the whole (torch's own requirements included) and installs psgd itself, built by
# the venv's setuptools (installed with the rest) instead of one pip fetches into a build environment
# of its own (--no-build-isolation: psgd's build and install took 2.4 s against 4.5 s); pip's own copy in the venv comes last,
# for `. .venv/bin/activate && pip install ...` (2.5 s; the venv's first pip, made at the start, cost 6 s).
$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv --system-site-packages --without-pip $(VENV)
	@$(BIN)/python -c "import pip, sys; sys.exit(int(pip.__version__.split('.')[0]) < 22)" 2>/dev/null \
		|| $(BIN)/python -m ensurepip --upgrade --default-pip >/dev/null
	@if $(BIN)/python -c "import torch" 2>/dev/null; then $(PIP) install -q --no-warn-conflicts $$($(NOT_TORCH)); else \
		echo "installing $(TORCH_SPEC) and psgd's requirements"; \
		$(PIP) install -q --no-warn-conflicts --no-deps "$(TORCH_SPEC)" $(INDEX) & torch=$$!; \
		$(PIP) install -q --no-warn-conflicts $$($(NOT_TORCH)); rest=$$?; \
		wait $$torch && test $$rest = 0; fi
	$(PIP) install -q --no-build-isolation -e '.[dev,notebook]' $(INDEX)
	@test -x $(BIN)/pip || $(PIP) install -q --ignore-installed --no-deps pip
	@touch $(STAMP)

# Three test processes (pytest-xdist) on 2 cores: most tests wait on the processes and sockets they
# start, so a third keeps the cores busy while two wait (measured on 2 idle cores: 231 s, 1.9 cores
# busy, against 266-286 s and 1.6-1.75 cores for two in the runs just before; one process was 238 s
# against 177 s for two, on fewer tests).
# `make test PYTEST_WORKERS=0` runs one.
# --dist worksteal: an idle process takes queued tests from the others, so no long test is left
# alone at the end (measured back to back on 2 idle cores: 136 s against 166 s with the default).
PYTEST_WORKERS ?= 3
# Hypothesis' pytest plugin, where the system's Python has it (the venv sees its packages), costs
# 1.5 s of import in each of the three pytest processes; no test uses it.
PYTEST_FLAGS := -q -n $(PYTEST_WORKERS) --dist worksteal -p no:hypothesispytest

# Bytecode first: with PYTHONDONTWRITEBYTECODE set (as in this project's development machines) no
# process caches what it compiles, and each of the hundred-odd processes the tests start compiled
# psgd's modules again (measured: 30 s of CPU in a run). compileall writes __pycache__/ (ignored by
# git) and recompiles only what changed since.
BYTECODE = $(BIN)/python -m compileall -q -j 2 psgd tests tools examples >/dev/null

test: install
	@$(BYTECODE)
	$(BIN)/python -m pytest $(PYTEST_FLAGS)

# The fast tier: the pure cores and the units (policies, rules, sharding, codec, optimizers, the
# shard core in process, statistics, plots), none of which starts a psgd process but the one sync
# run of test_kernel_hashes. About 40 s on 2 idle cores; `make test` runs these and all the rest.
FAST_TESTS := accounting analyses_backup_tail analyses_cluster analyses_diloco_outer analyses_elastic analyses_goyal \
	analyses_optim analyses_remedies analyses_staleness_aware analyses_time_to_accuracy backup \
	bench_transformer check_quotes codec config_data consistency costmodel devices doctor equivalence \
	eval_every kernel_hashes layers link optim outputs plots proto provenance reference remedies report server shard \
	sparsify staging staleness textbook threads tls trace trust verdicts worker
test-fast: install
	@$(BYTECODE)
	$(BIN)/python -m pytest $(PYTEST_FLAGS) $(patsubst %,tests/test_%.py,$(FAST_TESTS))

experiments: install
	$(BIN)/psgd suite experiments/default.toml

experiments-full: install
	$(BIN)/psgd suite experiments/default.toml --full

# The transformer claims that do not fit the default suite's 15 minutes (about 20 min on 2 cores).
experiments-transformer: install
	$(BIN)/psgd suite experiments/transformer.toml --out results/transformer

# The classic papers' claims on their own terms (E19-E21, E23; about 7 min on 2 cores): results/papers/.
experiments-papers: install
	$(BIN)/psgd suite experiments/papers.toml --out results/papers

# The classic claims at the scale they were made, SIMULATED (psgd/sim/; S1: the central-server bottleneck to
# 256 workers beside the cost model, S2: Dean 2012 / Ho 2013 at 32 workers, S3: Chen 2016's backup workers
# at 32 + 2, S4: Zhang 2016's staleness-aware rate at 32): results/scale/. Every figure and verdict says
# SIMULATED and its time model. Budgeted at most 20 min on 2 cores.
experiments-scale: install
	$(BIN)/psgd suite experiments/scale.toml --out results/scale

# Where parameter servers still win (E24-E26, issue 56): DLRM on click logs with its tables served by
# row, beside the MNIST-1D MLP; at most 15 min on 2 cores at its default profile: results/sparse/.
experiments-sparse: install
	$(BIN)/psgd suite experiments/sparse.toml --out results/sparse

# The five suites at the seeds the power rule asks for per claim (each experiment file's
# [profiles.reference], sized by psgd/lab/power.py at the claim's fixed margin from the committed
# spread, capped so that the suites' ETAs stay within 50, 60, 25, 75 and 30 min on 2 cores: `python
# -m psgd.lab.reference plan SUITE.toml FOREST.csv --cap-min M` prints the plan): results/reference/,
# results/transformer-reference/, results/papers-reference/, results/sparse-reference/,
# results/scale-reference/. The ETA does not weigh the CPU quotas of E2, E11, E19 and E20; the
# default profile's finished runs of the same configs are linked in, not made again. Each folder's
# command.txt says how long it took.
experiments-reference: install
	$(BIN)/psgd suite experiments/default.toml --reference
	$(BIN)/psgd suite experiments/transformer.toml --reference --out results/transformer-reference
	$(BIN)/psgd suite experiments/papers.toml --reference --out results/papers-reference
	$(BIN)/psgd suite experiments/sparse.toml --reference --out results/sparse-reference
	$(BIN)/psgd suite experiments/scale.toml --reference --out results/scale-reference

# The verdict tables of docs/results.md, from the committed reference runs (tests fail when stale): each
# suite's reference profile's (results/reference/, results/SUITE-reference/) where it has run, else its
# default profile's.
README_SUMMARIES = $(firstword $(wildcard results/reference/summary.json) results/summary.json) \
	$(firstword $(wildcard results/transformer-reference/summary.json) results/transformer/summary.json) \
	$(firstword $(wildcard results/papers-reference/summary.json) results/papers/summary.json) \
	$(firstword $(wildcard results/sparse-reference/summary.json) results/sparse/summary.json) \
	$(firstword $(wildcard results/scale-reference/summary.json) results/scale/summary.json)
readme: install
	$(BIN)/python -m psgd.lab.readme docs/results.md $(README_SUMMARIES)

proto: install
	$(BIN)/python tools/gen_proto.py

# On a GPU host: the gpu-marked tests, a 2-worker sync run on the GPU against the same run on the CPU,
# an overlapped run, `psgd bench transport --device cuda` and, with 2+ GPUs, NCCL vs the ring (E5),
# within 5 minutes; writes results/gpu/ and fails on any failure. CPU-only: says so, checks nothing, exit 0.
gpu-check: install
	$(BIN)/psgd doctor --gpu --out results/gpu

# A two-node Slurm 22.05 cluster on this machine (tools/slurm/cluster.py; apt-get installs slurm-wlm and
# munge where missing, as root), deploy/slurm/psgd_ps.sbatch under sbatch against psgd run, and scancel.
# Skips, saying why, where Slurm cannot be had. About 25 s (plus ~20 s the first time apt-get installs).
slurm-check: install
	$(BIN)/python -m pytest -q -rs tests/test_slurm.py

lint: install
	$(BIN)/ruff check psgd tests tools examples

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
