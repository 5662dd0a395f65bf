# The README's two commands (and the fast loop). Each sets up a fresh machine first
# (idempotent, fast when done).
VENV ?= .venv
export PDSERVE_VENV := $(VENV)

.PHONY: install run test test-fast lint bench

install:
	bash deploy/install.sh

run: install
	$(VENV)/bin/pdserve demo

# The linter, then everything, engines included: what CI runs (.ci/run). The slowest tests
# close the report: the suite's 20-minute budget is kept by reading them. Two pytest workers,
# each a module at a time with its own Ray cluster: one alone leaves a core idle while its
# tests wait on engines, timeouts and subprocesses (docs/benchmarks.md, "The test suite").
# Modules in collection order, the slow ones first (tests/conftest.py), not xdist's by size.
test: install lint
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

# No engine, no Ray, no pdserve process: the tests that answer in seconds.
test-fast: install
	$(VENV)/bin/python -m pytest -q -m "not engines"

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(VENV)/bin/python -m bench.disagg_vs_colocated
	$(VENV)/bin/python -m bench.stack_overhead
	$(VENV)/bin/python -m bench.nixl_transfer
	$(VENV)/bin/python -m bench.goodput_compare
	$(VENV)/bin/python -m bench.disagg_vs_colocated --tp 2 --lengths 128 1024
	$(VENV)/bin/python -m bench.overload --rate 6
	$(VENV)/bin/python -m bench.http_vs_grpc
	$(VENV)/bin/python -m bench.router_capacity --worker-niceness 15 0
	$(VENV)/bin/python -m bench.router_capacity --routers 1 2 --router-cpu 0.05 --streams 32 --tokens 64
	$(VENV)/bin/python -m bench.planner_shift
	$(VENV)/bin/python -m bench.planner_live
	$(VENV)/bin/python -m bench.vs_vllm
	$(VENV)/bin/python -m bench.prefix_reuse
	$(VENV)/bin/python -m bench.integrity_cost
	$(VENV)/bin/python -m bench.control_plane_start
