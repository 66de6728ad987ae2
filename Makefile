# Disagg developer entry points. `make test` and `make demo` are the README's two commands;
# both set up whatever is missing first (idempotent, cached outside the repo).
SHELL := /bin/bash
.DEFAULT_GOAL := help
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
DEMO_ARGS ?=
BENCH ?= all
BENCH_ARGS ?=

.PHONY: help setup engine-setup model k8s-bins prometheus-bin node-deps cluster-up cluster-down node-up node-down test test-unit demo bench crds clean

help:
	@echo "make demo          run a DisaggregatedModel locally and stream one chat answer"
	@echo "                   (DEMO_ARGS=--keep leaves it running: disagg status / disagg down)"
	@echo "make test          set up what is missing, run the whole suite"
	@echo "make bench         set up what is missing, run the benchmarks, write bench/ (BENCH=proxy|derender|serve|operator|soak|prefix)"
	@echo "make setup         venv + project + CPU vLLM (0.32, and the 0.33 and 0.34 lanes) + tiny test model (idempotent)"
	@echo "make cluster-up    start the local Kubernetes control plane (.cluster/kubeconfig)"
	@echo "make cluster-down  stop it (and the real node, if up)"
	@echo "make node-up       start the cluster (if needed) and a real kubelet node in it (docs/development.md)"
	@echo "make node-down     stop the real node, undoing every change it made to the machine"

setup:
	@scripts/setup
	@scripts/vllm-lane 0.33 >/dev/null
	@scripts/vllm-lane 0.34 >/dev/null

k8s-bins:
	@scripts/k8s-bins >/dev/null

# `make test` needs no target for it: the harness builds it in the background (tests/harness/prometheus.py).
prometheus-bin:
	@scripts/prometheus-bin >/dev/null

node-deps:
	@scripts/node-deps

cluster-up:  # scripts/cluster builds the control-plane binaries it lacks (not kubelet)
	@scripts/cluster up

cluster-down:
	@scripts/cluster down

node-up: cluster-up  # scripts/node installs its packages and builds kubelet/kube-proxy if missing
	@scripts/node up

node-down:
	@scripts/node down

test: setup k8s-bins node-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-unit: setup
	$(BIN)/python -m pytest -m "not engine and not cluster and not e2e" $(PYTEST_ARGS)

demo: setup
	$(BIN)/python -m disagg_cli.demo $(DEMO_ARGS)

# Starts its own vLLM servers and (for the operator part) the local control plane; bench/RESULTS.md.
bench: setup k8s-bins
	@benchmarks/setup >/dev/null
	$(BIN)/python -m benchmarks.run $(BENCH) $(BENCH_ARGS)

# crds/kopf.dev_*.yaml (kopf's peering CRDs, for replicas > 1) are kept by hand; all are copied.
crds: setup
	$(BIN)/disagg crd > crds/disagg.dev_disaggregatedmodels.yaml
	cp crds/*.yaml charts/disagg/crds/

clean: cluster-down
	rm -rf $(VENV) .cluster .disagg
