# Disagg's CPU engine image: vLLM's stock CPU image of one version plus the `disagg` package, so the
# render and derender pools can load Disagg's engine extension (VLLM_PLUGINS=disagg, which the
# operator sets when engine.renderExtension is on, the default). It is the default engine.cpuImage,
# tagged by the vLLM version it is built on, beside the operator image (Dockerfile):
#
#   docker build -f images/vllm-cpu.Dockerfile --build-arg VLLM_VERSION=0.34.0 \
#     -t ghcr.io/disagg/vllm-cpu:v0.34.0 .
#
# Only the package is added (no dependencies): the extension imports vLLM and what vLLM already
# brings (fastapi, starlette, pydantic). The image keeps the base image's entrypoint, user and
# Python; the operator runs it as `vllm launch render ...` with a non-root uid of its own (runAsUser). Without a Docker
# engine (the local cluster's real node), scripts/disagg-images writes an image with the same
# purpose (disagg.local/vllm-cpu:local) from the host's dependency cache (docs/development.md).

ARG VLLM_VERSION=0.34.0

FROM python:3.11-slim AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml ./
COPY operator/ operator/
COPY sidecar/ sidecar/
COPY engine/ engine/
COPY cli/ cli/
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM vllm/vllm-openai-cpu:v${VLLM_VERSION}
COPY --from=wheel /wheels /tmp/wheels
# The interpreter that runs `vllm` gets the package. `disagg` declares Python 3.11 for its own
# images; the wheel is pure Python and the extension runs in vLLM's interpreter, whatever its version.
# The entry point must be visible to vLLM's plugin loader, or the pools would silently run without it.
RUN set -eu; \
    py="$(head -n1 "$(command -v vllm)" | sed 's/^#!//')"; \
    "$py" -m pip install --no-deps --no-cache-dir --ignore-requires-python /tmp/wheels/*.whl; \
    rm -rf /tmp/wheels; \
    "$py" -c "from importlib.metadata import entry_points; \
assert 'disagg' in {e.name for e in entry_points(group='vllm.endpoint_plugins')}"
