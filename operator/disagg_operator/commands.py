"""`disagg crd`, `disagg manifests FILE`, `disagg scrape-config FILE` and `disagg operator`: argv in,
exit code out.

kopf and the Kubernetes client are imported only by `disagg operator`, so the other commands
work anywhere pydantic and PyYAML are installed (GitOps pipelines, CI).
"""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml


CRD_RETRY_SECONDS = 60.0


def crd_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="disagg crd", description="Print the DisaggregatedModel CRD (YAML).")
    parser.parse_args(list(argv))
    from disagg_operator.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def _documents(path: str, stdin: TextIO) -> list[Any]:
    text = stdin.read() if path == "-" else Path(path).read_text()
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def render_manifests(documents: Iterable[Any], default_namespace: str) -> list[dict[str, Any]]:
    """Every object for every DisaggregatedModel in ``documents`` (SpecError on a bad one)."""
    from disagg_operator.kinds import BY_TYPE
    from disagg_operator.objects import build_objects
    from disagg_operator.objects.secrets import with_new_key
    from disagg_operator.plan import build_plan
    from disagg_operator.manifest import parse_manifest
    from disagg_operator.spec import API_VERSION, KIND, SpecError

    out: list[dict[str, Any]] = []
    for i, doc in enumerate(documents):
        if not isinstance(doc, dict) or doc.get("kind") != KIND:
            kind = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
            raise SpecError([f"document {i + 1} is a {kind}, not a {API_VERSION} {KIND}"], "input")
        manifest = parse_manifest(doc, default_namespace)
        objects = build_objects(build_plan(manifest.spec, manifest.name, manifest.namespace))
        # PodMonitors on "auto" depend on the cluster serving their CRD, which a manifest cannot know:
        # printed only when asked for ("true"), so `kubectl apply` works on clusters without them.
        if manifest.spec.monitoring.pod_monitors != "true":
            objects = [o for o in objects if o["kind"] != "PodMonitor"]
        # What the operator creates once gets its key here (`kubectl apply` of it again would rotate it).
        out += [with_new_key(o) if BY_TYPE[(o["apiVersion"], o["kind"])].create_only else o for o in objects]
    return out


def manifests_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="disagg manifests",
        description="Print the Kubernetes objects for DisaggregatedModel(s) in FILE as a YAML stream "
        "(the same objects the operator applies, without owner references).",
    )
    parser.add_argument("file", metavar="FILE", help="YAML file with one or more DisaggregatedModels ('-': stdin)")
    parser.add_argument("-n", "--namespace", default="default",
                        help="namespace for objects whose metadata has none (default: %(default)s)")
    args = parser.parse_args(list(argv))
    from disagg_operator.spec import SpecError

    try:
        objects = render_manifests(_documents(args.file, sys.stdin), args.namespace)
    except (OSError, yaml.YAMLError) as exc:
        print(f"disagg manifests: cannot read {args.file}: {exc}", file=sys.stderr)
        return 1
    except SpecError as exc:
        print(f"disagg manifests: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False, default_flow_style=False))
    return 0


def monitors_of(documents: Iterable[Any], default_namespace: str) -> list[dict[str, Any]]:
    """The PodMonitors of ``documents``: a DisaggregatedModel's as the operator writes them (also on
    podMonitors "auto"), a PodMonitor as it is, a List's items in turn; other objects (a model's
    claims beside it) have none."""
    from disagg_operator.manifest import parse_manifest
    from disagg_operator.objects.monitors import pod_monitors
    from disagg_operator.plan import build_plan
    from disagg_operator.scrape_configs import KIND as MONITOR
    from disagg_operator.spec import KIND, SpecError

    out: list[dict[str, Any]] = []
    for doc in documents:
        kind = doc.get("kind") if isinstance(doc, dict) else None
        if isinstance(doc, dict) and isinstance(kind, str) and kind.endswith("List"):
            out += monitors_of(doc.get("items") or [], default_namespace)
        elif isinstance(doc, dict) and (doc.get("apiVersion"), kind) == MONITOR:
            out.append({**doc, "metadata": {"namespace": default_namespace, **doc.get("metadata", {})}})
        elif kind == KIND:
            manifest = parse_manifest(doc, default_namespace)
            if manifest.spec.monitoring.pod_monitors == "false":
                raise SpecError([f"{manifest.name}: spec.monitoring.podMonitors is false: no monitors"], "input")
            out += pod_monitors(build_plan(manifest.spec, manifest.name, manifest.namespace))
    return out


def scrape_config_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="disagg scrape-config",
        description="Print the Prometheus scrape_configs equivalent to a model's PodMonitors, for a Prometheus "
        "without the Prometheus Operator (docs/autoscaling.md). FILE holds DisaggregatedModels (their monitors "
        "are rendered as the operator writes them) or PodMonitors, e.g. `kubectl get podmonitors -o yaml`.",
    )
    parser.add_argument("file", metavar="FILE", help="YAML file ('-': stdin)")
    parser.add_argument("-n", "--namespace", default="default",
                        help="namespace for objects whose metadata has none (default: %(default)s)")
    parser.add_argument("--kubeconfig-file", metavar="PATH", default=None,
                        help="a kubeconfig for the pod discovery, for a Prometheus outside the cluster "
                        "(default: none, Prometheus's in-cluster service account)")
    parser.add_argument("--secrets-dir", metavar="DIR", default=None,
                        help="where Secrets a monitor reads (the engines' CA with spec.security.tls) are mounted, "
                        "one directory per Secret (default: /etc/prometheus/secrets)")
    args = parser.parse_args(list(argv))
    from disagg_operator.scrape_configs import SECRETS_DIR, scrape_configs
    from disagg_operator.spec import KIND, SpecError

    try:
        monitors = monitors_of(_documents(args.file, sys.stdin), args.namespace)
        if not monitors:
            raise SpecError([f"no {KIND} and no PodMonitor in {args.file}"], "input")
        jobs = scrape_configs(monitors, kubeconfig_file=args.kubeconfig_file,
                              secrets_dir=args.secrets_dir or SECRETS_DIR)
    except (OSError, yaml.YAMLError) as exc:
        print(f"disagg scrape-config: cannot read {args.file}: {exc}", file=sys.stderr)
        return 1
    except (SpecError, ValueError, KeyError, TypeError) as exc:
        print(f"disagg scrape-config: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump({"scrape_configs": jobs}, sort_keys=False, default_flow_style=False))
    return 0


def peering_priority(peering: str | None, priority: int | None) -> int | None:
    """The kopf peering priority: ``priority`` if given, else random when peering (None: standalone).

    kopf peering is leader election only with distinct priorities: a replica pauses while a live peer
    has a higher priority, and *every* replica pauses while the highest priority is shared. A random
    31-bit priority per process makes a tie practically impossible, so exactly one replica works; a
    replica that stops gracefully removes itself from the peering object at once (the next-highest
    resumes), a killed one expires after the peering lifetime (60 s).
    """
    if peering is None or priority is not None:
        return priority
    return secrets.randbelow(2**31)


def operator_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="disagg operator", description="Run the DisaggregatedModel operator (kopf). Watches all namespaces "
        "unless --namespace is given.",
    )
    parser.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                        help="watch only this namespace (repeatable)")
    parser.add_argument("--liveness", metavar="URL", default=None,
                        help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--peering", metavar="NAME", default=None,
                        help="run as one of several replicas coordinated through the kopf peering object "
                        "NAME (a ClusterKopfPeering cluster-wide, a KopfPeering in each --namespace; it must "
                        "exist): only the live replica with the highest priority works, the others stand by "
                        "(default: standalone, one replica)")
    parser.add_argument("--priority", type=int, default=None, metavar="N",
                        help="this replica's peering priority (needs --peering; default: random, so that "
                        "replicas never tie: kopf pauses every replica when the top priority is shared)")
    parser.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                        help="serve Prometheus metrics on this port (default: off)")
    parser.add_argument("--metrics-address", default="0.0.0.0", metavar="ADDR")
    parser.add_argument("--crd-retry-seconds", type=float, default=CRD_RETRY_SECONDS, metavar="S",
                        help="how often a model whose spec needs a CRD the cluster lacks (e.g. InferencePool) "
                        "is converged again, so installing the CRD later takes effect (default: %(default)s)")
    parser.add_argument("--no-pod-monitors", action="store_true",
                        help="write no PodMonitors (the operator has no RBAC on them): models asking for them "
                        "(spec.monitoring.podMonitors: true) say so in their status")
    parser.add_argument("--no-planner", action="store_true",
                        help="do not run the planner of spec.autoscaling (the operator may not scale Deployments)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(list(argv))
    if args.priority is not None and args.peering is None:
        parser.error("--priority needs --peering")
    if args.crd_retry_seconds <= 0:
        parser.error("--crd-retry-seconds must be positive")

    import kopf

    from disagg_operator import handlers
    from disagg_operator.kinds import POD_MONITOR, WATCHED_KINDS
    from disagg_operator.metrics import serve

    withheld = frozenset({POD_MONITOR} if args.no_pod_monitors else ())
    handlers.register(tuple(k for k in WATCHED_KINDS if k not in withheld))
    if not args.no_planner:
        from disagg_operator import planner_handlers  # noqa: F401  (registers the planner's timer)

    kopf.configure(verbose=args.verbose)
    if args.metrics_port:
        serve(args.metrics_port, args.metrics_address)
    settings = kopf.OperatorSettings()
    # No scanning: it lists namespaces and CRDs cluster-wide, which the chart's least-privilege
    # accounts may not, and kopf retries the refusals for ~55 s before it reconciles anything (seen
    # in a real pod). The operator serves one resource, its CRD, installed before it starts.
    settings.scanning.disabled = True
    kopf.run(
        settings=settings,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=args.peering is None,
        peering_name=args.peering,
        priority=peering_priority(args.peering, args.priority),
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(crd_retry_seconds=args.crd_retry_seconds, withheld=withheld),
    )
    return 0
