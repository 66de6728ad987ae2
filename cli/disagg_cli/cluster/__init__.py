"""The local Kubernetes control plane for tests and benchmarks: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok (two fake nodes), all on 127.0.0.1, with the
binaries scripts/k8s-bins builds, and the real kubelet node beside them. ``scripts/cluster
up|down|status`` runs ``python -m disagg_cli.cluster``, ``scripts/node up|down|status`` its ``node``
command; docs/development.md describes both.

Pure parts: ``layout`` (state dir, ports, cluster.env, the cluster's network facts), ``components``
(command lines, fake nodes), ``node_config`` (the real node's facts and files),
``pki.kubeconfig_text``; I/O: ``pki`` (openssl), ``lifecycle`` (the control plane's up/down/status),
``node`` (the real node's). Standard library only, like ``disagg_engine.processes``: it runs on a
bare python3.11 too.
"""
