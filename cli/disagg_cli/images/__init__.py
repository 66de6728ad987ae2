"""Container images without a registry or a daemon, for the real node (``disagg_cli.cluster.node``).

``oci`` writes an OCI archive from host files (standard library only: scripts/node-images runs it
for the node's pause and busybox images); ``build`` makes the operator/sidecar and CPU engine images
(``scripts/disagg-images``).
"""
