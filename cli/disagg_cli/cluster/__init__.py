"""The local Kubernetes control plane for tests and benchmarks: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok (two fake nodes), all on 127.0.0.1, with the
binaries scripts/k8s-bins builds. ``scripts/cluster up|down|status`` runs ``python -m
disagg_cli.cluster``; docs/development.md describes it.

Pure parts: ``layout`` (state dir, ports, cluster.env), ``components`` (command lines, fake
nodes), ``pki.kubeconfig_text``; I/O: ``pki`` (openssl), ``lifecycle`` (up/down/status).
Standard library only, like ``disagg_engine.processes``: it runs on a bare python3.11 too.
"""
