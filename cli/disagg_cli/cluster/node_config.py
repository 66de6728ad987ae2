"""The real node's facts and the files it runs from (pure: paths and ports in, texts out).

A real kubelet node beside the kwok nodes: containerd + runc + the CNI bridge plugin (Debian's
packages, scripts/node-deps), kubelet and kube-proxy (scripts/k8s-bins), local images
(scripts/node-images). It joins as ``disagg-node``, tainted ``disagg.dev/real-node:NoSchedule`` so
only pods that tolerate it run real containers there. Pods reach the API server through the
``kubernetes`` Service (its endpoint is a relay on the node IP to the loopback-only apiserver) and
resolve Service names with CoreDNS on the node IP (scripts/node-coredns), which answers for the
cluster domain only: nothing is forwarded off the machine. ``node.py`` starts and stops it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from disagg_cli.cluster import pki
from disagg_cli.cluster.layout import CLUSTER_DOMAIN, SERVICE_CIDR

NODE_NAME = "disagg-node"
TAINT = "disagg.dev/real-node"
BRIDGE = "disagg0"
POD_CIDR = "10.244.0.0/24"
NODE_IP = "10.244.0.1"  # the bridge's address is the node's InternalIP
CTR_NAMESPACE = "k8s.io"  # containerd's namespace for the CRI (kubelet's containers and images)
SANDBOX_IMAGE = "disagg.local/pause:1"  # scripts/node-images builds it
LOCK = Path("/run/lock/disagg-node.lock")  # one real node per machine: held by its processes while they live
OWNER = Path("/run/lock/disagg-node.owner")  # the state dir of the node holding the lock
IPTABLES_GUARD = "DISAGG-NODE"  # our chain: rejects traffic DNATed off this node's pods
CNI_NETWORK = NODE_NAME  # the bridge plugin's results are named after it (/var/lib/cni/results)
DNS_USER = f"system:{NODE_NAME}-dns"  # CoreDNS's identity
# The node's ports, all on NODE_IP.
KUBELET_PORT, KUBELET_HEALTHZ_PORT = 10250, 10248
PROXY_HEALTHZ_PORT, PROXY_METRICS_PORT = 10256, 10249
DNS_READY_PORT = 8181
CONTAINERD_TIMEOUT = 60  # seconds for containerd to answer; the other waits take the cluster's timeout
LOCK_TIMEOUT = 600  # seconds `up` waits for another state dir's node ($DISAGG_NODE_LOCK_TIMEOUT)
# hostPath PersistentVolumes for examples/cluster-tiny.yaml (scripts/disagg-images mounts the first).
HOST_CACHE_VOLUME, KV_VOLUME, ENGINE_CACHE_VOLUME = "disagg-host-cache", "disagg-kv-shared", "disagg-engine-cache"

# What kubelet (kernel tunables), the bridge plugin (forwarding) and kube-proxy may change.
SYSCTLS = ("vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
           "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes", "net.ipv4.ip_forward",
           "net.ipv4.conf.all.forwarding", "net.ipv6.conf.all.forwarding", "net.ipv4.conf.all.route_localnet",
           "net.bridge.bridge-nf-call-iptables", "net.bridge.bridge-nf-call-ip6tables", "net.netfilter.nf_conntrack_max",
           "net.netfilter.nf_conntrack_tcp_timeout_established", "net.netfilter.nf_conntrack_tcp_timeout_close_wait")
# Fixed paths outside the state dir that kubelet, containerd or CNI create.
HOST_PATHS = ("/var/lib/kubelet", "/var/log/containers", "/var/log/pods", "/var/lib/cni", "/run/netns",
              "/run/containerd", "/etc/cni", "/opt/cni", "/opt/containerd")
PROCESSES = ("coredns", "api-relay", "kube-proxy", "kubelet", "containerd")  # stop order
# Chains kube-proxy, the CNI plugins and we add (the others are the machine's).
OUR_CHAIN_PREFIXES = ("KUBE-", "CNI-", "DISAGG-")
IPTABLES_TABLES = ("filter", "nat", "mangle", "raw")


@dataclass(frozen=True)
class Certificate:
    name: str  # <pki>/<name>.crt and .key
    subject: str
    extensions: str
    kubeconfig: bool  # a client: also <pki>/<name>.kubeconfig


CERTIFICATES = (
    Certificate("node-kubelet", f"/O=system:nodes/CN=system:node:{NODE_NAME}", pki.CLIENT, True),
    Certificate("node-kubelet-serving", f"/CN={NODE_NAME}", pki.server([f"IP:{NODE_IP}", f"DNS:{NODE_NAME}"]), False),
    Certificate("node-proxy", "/CN=system:kube-proxy", pki.CLIENT, True),
    Certificate("node-dns", f"/CN={DNS_USER}", pki.CLIENT, True),
)


@dataclass(frozen=True)
class NodeDir:
    """The node's state dir (<cluster state>/node) and the cluster's PKI it reads."""
    dir: Path
    pki: Path

    @property
    def socket(self) -> Path:
        return self.dir / "containerd.sock"

    def pidfile(self, name: str) -> Path:
        return self.dir / "pids" / name

    def log(self, name: str) -> Path:
        return self.dir / "logs" / f"{name}.log"


def containerd_toml(n: NodeDir) -> str:
    d = n.dir
    return f"""version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
# opt: would create /opt/containerd; the others are snapshotters this node does not use.
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "{n.socket}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{SANDBOX_IMAGE}"
  # Root here lacks CAP_SYS_RESOURCE: lowering a container's oom_score_adj below containerd's
  # own fails every sandbox ("can't get final child's PID from pipe: EOF").
  restrict_oom_score_adj = true
  disable_apparmor = true
  netns_mounts_under_state_dir = true   # the pods' network namespaces under the node dir, not /run/netns
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{d}/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{d}/net.d"
    max_conf_num = 1
"""


def cni_conflist(n: NodeDir) -> str:
    # No default route in pods: they reach each other, the node and Services, nothing else.
    return f"""{{"cniVersion": "1.0.0", "name": "{CNI_NETWORK}", "plugins": [{{
  "type": "bridge", "bridge": "{BRIDGE}", "isGateway": true, "ipMasq": false, "hairpinMode": true,
  "ipam": {{"type": "host-local", "ranges": [[{{"subnet": "{POD_CIDR}", "gateway": "{NODE_IP}"}}]],
           "routes": [{{"dst": "{SERVICE_CIDR}"}}], "dataDir": "{n.dir}/cni-ipam"}}}}]}}
"""


def kubelet_yaml(n: NodeDir) -> str:
    return f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {NODE_IP}
port: {KUBELET_PORT}
readOnlyPort: 0
healthzBindAddress: {NODE_IP}
healthzPort: {KUBELET_HEALTHZ_PORT}
tlsCertFile: {n.pki}/node-kubelet-serving.crt
tlsPrivateKeyFile: {n.pki}/node-kubelet-serving.key
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {n.pki}/ca.crt}}
authorization: {{mode: Webhook}}
failCgroupV1: false   # this machine has cgroup v1 only
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://{n.socket}
podLogsDir: {n.dir}/pod-logs
volumePluginDir: {n.dir}/volume-plugins
resolvConf: ""   # pods get the cluster's resolver only, never the host's (nothing leaves the machine)
clusterDNS: [{NODE_IP}]   # CoreDNS, a node process like kube-proxy
clusterDomain: {CLUSTER_DOMAIN}
registerWithTaints: [{{key: {TAINT}, value: "true", effect: NoSchedule}}]
# A small shared disk must not evict the test pods, nor image GC remove the local-only images.
evictionHard: {{memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
failSwapOn: false
oomScoreAdj: 0   # lowering it needs CAP_SYS_RESOURCE, which root lacks here
"""


def kube_proxy_yaml(n: NodeDir) -> str:
    return f"""apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {{kubeconfig: {n.pki}/node-proxy.kubeconfig}}
hostnameOverride: {NODE_NAME}
mode: iptables
bindAddress: {NODE_IP}
healthzBindAddress: {NODE_IP}:{PROXY_HEALTHZ_PORT}
metricsBindAddress: {NODE_IP}:{PROXY_METRICS_PORT}
clusterCIDR: {POD_CIDR}
nodePortAddresses: ["{NODE_IP}/32"]
iptables: {{localhostNodePorts: false}}   # else it sets route_localnet
conntrack: {{maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}   # leave the host's
oomScoreAdj: 0
"""


def corefile(n: NodeDir) -> str:
    # Service and pod names only: no `forward`, so other names fail at once in pods (SERVFAIL).
    return f""".:53 {{
  bind {NODE_IP}
  errors
  ready {NODE_IP}:{DNS_READY_PORT}
  kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
    kubeconfig {n.pki}/node-dns.kubeconfig
    pods insecure
    ttl 5
  }}
  cache 5
}}
"""


def config_files(n: NodeDir) -> dict[Path, str]:
    """Every file the node's processes read, by path."""
    return {n.dir / "containerd.toml": containerd_toml(n), n.dir / "net.d" / "10-disagg.conflist": cni_conflist(n),
            n.dir / "kubelet.yaml": kubelet_yaml(n), n.dir / "kube-proxy.yaml": kube_proxy_yaml(n),
            n.dir / "Corefile": corefile(n)}


def commands(n: NodeDir, bin_dir: str, coredns: str, api_port: int) -> dict[str, list[str]]:
    """The node's processes' command lines, in start order."""
    return {
        "containerd": ["/usr/bin/containerd", "--config", f"{n.dir}/containerd.toml"],
        "kubelet": [f"{bin_dir}/kubelet", f"--config={n.dir}/kubelet.yaml", f"--kubeconfig={n.pki}/node-kubelet.kubeconfig",
                    f"--root-dir={n.dir}/kubelet", f"--hostname-override={NODE_NAME}", f"--node-ip={NODE_IP}",
                    f"--node-labels={TAINT}=true"],
        "kube-proxy": [f"{bin_dir}/kube-proxy", f"--config={n.dir}/kube-proxy.yaml"],
        # TLS passes through the relay untouched: pods verify the apiserver's own certificate (its
        # SANs include the Service IP and kubernetes.default.svc).
        "api-relay": ["/usr/bin/socat", f"TCP-LISTEN:{api_port},bind={NODE_IP},reuseaddr,fork", f"TCP:127.0.0.1:{api_port}"],
        "coredns": [coredns, "-conf", f"{n.dir}/Corefile"],
    }


def guard_rules() -> list[list[str]]:
    """Traffic that kube-proxy DNATs to an address outside this node's pods (a kwok pod's made-up IP)
    would leave the machine: reject it. Pods have no default route, so this covers the node itself."""
    return [["-N", IPTABLES_GUARD],
            ["-A", IPTABLES_GUARD, "-m", "conntrack", "--ctstate", "DNAT", "!", "-d", POD_CIDR, "-j", "REJECT"],
            ["-I", "OUTPUT", "1", "-j", IPTABLES_GUARD], ["-I", "FORWARD", "1", "-j", IPTABLES_GUARD]]


def cluster_objects(n: NodeDir, host_cache: str, engine_cache: str, api_port: int) -> str:
    """In-cluster objects the node needs, as YAML: the `kubernetes` Service's endpoint (the relay;
    the apiserver runs with --endpoint-reconciler-type=none), read access for CoreDNS, and three
    hostPath volumes for examples/cluster-tiny.yaml: the host cache read-only (the engine image's
    dependency tree and the tiny model, see disagg_cli.images) and two directories every pod may
    write: ExampleConnector KV, and the engines' HOME (engine.cacheClaim: vLLM's caches, kept across
    node restarts). Each binds one claim at a time; a Released one is made Available again by
    clearing its claimRef."""
    def volume(name: str, size: str, mode: str, path: str) -> str:
        return f"""apiVersion: v1
kind: PersistentVolume
metadata: {{name: {name}}}
spec:
  capacity: {{storage: {size}}}
  accessModes: [{mode}]
  storageClassName: {name}
  persistentVolumeReclaimPolicy: Retain
  hostPath: {{path: "{path}", type: Directory}}
---
"""
    return (volume(HOST_CACHE_VOLUME, "100Gi", "ReadOnlyMany", host_cache)
            + volume(KV_VOLUME, "10Gi", "ReadWriteMany", f"{n.dir}/kv-shared")
            + volume(ENGINE_CACHE_VOLUME, "10Gi", "ReadWriteMany", engine_cache)
            + f"""apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kubernetes
  namespace: default
  labels: {{kubernetes.io/service-name: kubernetes, endpointslice.kubernetes.io/managed-by: disagg.dev-node}}
addressType: IPv4
endpoints: [{{addresses: ["{NODE_IP}"], conditions: {{ready: true}}}}]
ports: [{{name: https, port: {api_port}, protocol: TCP}}]
---
apiVersion: v1
kind: Endpoints
metadata:
  name: kubernetes
  namespace: default
  labels: {{endpointslice.kubernetes.io/skip-mirror: "true"}}
subsets: [{{addresses: [{{ip: "{NODE_IP}"}}], ports: [{{name: https, port: {api_port}, protocol: TCP}}]}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: "{NODE_NAME}:dns"}}
rules:
- {{apiGroups: [""], resources: [services, namespaces, pods], verbs: [list, watch]}}
- {{apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: "{NODE_NAME}:dns"}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "{NODE_NAME}:dns"}}
subjects: [{{apiGroup: rbac.authorization.k8s.io, kind: User, name: "{DNS_USER}"}}]
""")


# --- iptables: which chains are ours, which rules jump into them --------------------------------

def chains(table: str, save_text: str) -> set[str]:
    """``"<table> <chain>"`` for every chain in an ``iptables-save -t <table>`` text."""
    return {f"{table} {line[1:].split()[0]}" for line in save_text.splitlines() if line.startswith(":")}


def added_chains(now: set[str], before: set[str]) -> set[str]:
    """Chains of ours (kube-proxy's, CNI's, the guard) that were not there before the node."""
    return {c for c in now - before if c.split(" ", 1)[1].startswith(OUR_CHAIN_PREFIXES)}


def jumps_into(table: str, save_text: str, ours: set[str]) -> list[str]:
    """The rules (``-A CHAIN ...`` as saved) of other chains of ``table`` that jump or go to one of
    ``ours``: they must go before our chains can be deleted."""
    found = []
    for rule in save_text.splitlines():
        if not rule.startswith("-A "):
            continue
        words = rule.split()
        if f"{table} {words[1]}" in ours:
            continue
        targets = [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("-j", "-g")]
        if any(f"{table} {t}" in ours for t in targets):
            found.append(rule)
    return found
