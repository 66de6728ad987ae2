"""The components' command lines and the fake nodes (pure: a Cluster in, argument lists out)."""

from __future__ import annotations

from disagg_cli.cluster.layout import CLUSTER_DOMAIN, NODES, SERVICE_CIDR, Cluster


def etcd(c: Cluster) -> list[str]:
    client, peer = f"http://127.0.0.1:{c.ports.etcd}", f"http://127.0.0.1:{c.ports.etcd_peer}"
    return [c.exe("etcd"), "--name=disagg", f"--data-dir={c.dir}/etcd", "--unsafe-no-fsync=true",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=disagg={peer}", "--log-level=warn"]


def apiserver(c: Cluster) -> list[str]:
    # Default admission plugins stay on (ServiceAccount, ValidatingAdmissionPolicy, webhooks, ...).
    # endpoint-reconciler none: a loopback advertise address is not a valid Endpoints IP.
    p = c.pki
    return [c.exe("kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{c.ports.etcd}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={c.ports.api}",
            f"--cert-dir={p}", f"--tls-cert-file={p}/apiserver.crt", f"--tls-private-key-file={p}/apiserver.key",
            f"--client-ca-file={p}/ca.crt",
            f"--service-account-issuer=https://kubernetes.default.svc.{CLUSTER_DOMAIN}",
            f"--service-account-key-file={p}/sa.pub", f"--service-account-signing-key-file={p}/sa.key",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--authorization-mode=Node,RBAC",
            "--allow-privileged=true",
            f"--requestheader-client-ca-file={p}/front-proxy-ca.crt", "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={p}/front-proxy-client.crt", f"--proxy-client-key-file={p}/front-proxy-client.key",
            "--endpoint-reconciler-type=none", "--profiling=false",
            "--kubelet-preferred-address-types=InternalIP", f"--kubelet-certificate-authority={p}/ca.crt",
            f"--kubelet-client-certificate={p}/apiserver-kubelet-client.crt",
            f"--kubelet-client-key={p}/apiserver-kubelet-client.key"]


def _authn(c: Cluster, name: str) -> list[str]:
    kubeconfig = f"{c.pki}/{name}.kubeconfig"
    return [f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}"]


def controller_manager(c: Cluster) -> list[str]:
    p = c.pki
    return [c.exe("kube-controller-manager"), *_authn(c, "kube-controller-manager"),
            "--bind-address=127.0.0.1", f"--secure-port={c.ports.kcm}", f"--cert-dir={p}/kcm",
            "--leader-elect=false", "--use-service-account-credentials=true", f"--root-ca-file={p}/ca.crt",
            f"--service-account-private-key-file={p}/sa.key",
            f"--cluster-signing-cert-file={p}/ca.crt", f"--cluster-signing-key-file={p}/ca.key", "--profiling=false",
            "--node-monitor-grace-period=180s"]  # kwok heartbeats lag on a loaded 2-core machine: no NotReady flaps


def scheduler(c: Cluster) -> list[str]:
    return [c.exe("kube-scheduler"), *_authn(c, "kube-scheduler"), "--bind-address=127.0.0.1",
            f"--secure-port={c.ports.scheduler}", f"--cert-dir={c.pki}/sched", "--leader-elect=false",
            "--profiling=false"]


def kwok(c: Cluster) -> list[str]:
    # kwok manages only nodes carrying our annotation; pods bound to them become Running/Ready.
    # The lease flag is needed: run without a config file kwok v0.7.0 defaults it to 0, which
    # selects a node heartbeat of 10-20 min, so KCM marks the nodes NotReady every ~50 s (and
    # their pods unready). With a lease kwok renews it every 10 s, like a kubelet.
    return [c.exe("kwok"), f"--kubeconfig={c.pki}/kwok.kubeconfig", "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake", "--node-lease-duration-seconds=40",
            f"--server-address=127.0.0.1:{c.ports.kwok}", "--v=WARN"]  # INFO logs every heartbeat patch


def fake_nodes() -> str:
    """The kwok nodes as YAML for `kubectl apply -f -`."""
    return "".join(f"""---
apiVersion: v1
kind: Node
metadata:
  name: {n}
  annotations: {{kwok.x-k8s.io/node: fake, node.alpha.kubernetes.io/ttl: "0"}}
  labels: {{kubernetes.io/hostname: {n}, kubernetes.io/os: linux, kubernetes.io/arch: amd64, type: kwok}}
status:
  allocatable: {{cpu: "96", memory: 1152Gi, pods: "110", nvidia.com/gpu: "8"}}
  capacity: {{cpu: "96", memory: 1152Gi, pods: "110", nvidia.com/gpu: "8"}}
  nodeInfo: {{architecture: amd64, operatingSystem: linux, kubeletVersion: fake, kubeProxyVersion: fake}}
""" for n in NODES)
