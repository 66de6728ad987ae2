# Disagg developer entry points. `make test` and `make demo` are the README's two commands;
# both set up whatever is missing first (idempotent, cached outside the repo).
SHELL := /bin/bash
.DEFAULT_GOAL := help
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: help setup engine-setup model k8s-bins cluster-up cluster-down test test-unit demo crds clean

help:
	@echo "make demo          run a DisaggregatedModel locally and stream one chat answer"
	@echo "                   (DEMO_ARGS=--keep leaves it running: disagg status / disagg down)"
	@echo "make test          set up what is missing, run the whole suite"
	@echo "make setup         venv + project + CPU vLLM (0.32, and the 0.33 lane) + tiny test model (idempotent)"
	@echo "make cluster-up    start the local Kubernetes control plane (.cluster/kubeconfig)"
	@echo "make cluster-down  stop it"

setup:
	@scripts/setup
	@scripts/vllm-lane >/dev/null

k8s-bins:
	@scripts/k8s-bins >/dev/null

cluster-up: k8s-bins
	@scripts/cluster up

cluster-down:
	@scripts/cluster down

test: setup k8s-bins
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-unit: setup
	$(BIN)/python -m pytest -m "not engine and not cluster and not e2e" $(PYTEST_ARGS)

demo: setup
	$(BIN)/python -m disagg_cli.demo $(DEMO_ARGS)

# crds/kopf.dev_*.yaml (kopf's peering CRDs, for replicas > 1) are kept by hand; all are copied.
crds: setup
	$(BIN)/disagg crd > crds/disagg.dev_disaggregatedmodels.yaml
	cp crds/*.yaml charts/disagg/crds/

clean:
	rm -rf $(VENV) .cluster .disagg
