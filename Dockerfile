# The Disagg operator + sidecar image: the `disagg` package with its light default dependencies
# (pydantic, PyYAML, aiohttp, orjson, kopf, kubernetes, prometheus-client). No vLLM, no torch: the engine
# pods run the vLLM images named in each DisaggregatedModel.
#
#   docker build -t ghcr.io/disagg/disagg:0.1.0 .
#   docker run --rm ghcr.io/disagg/disagg:0.1.0 --help
#
# The Helm chart runs it as `disagg operator ...`; the operator runs it as `disagg sidecar ...`.
# Without a Docker engine (the local cluster's real node), scripts/disagg-images writes the same
# content as an OCI archive (disagg.local/disagg:local) from the host's Python and dependency cache.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml ./
COPY operator/ operator/
COPY sidecar/ sidecar/
COPY engine/ engine/
COPY cli/ cli/
RUN python -m venv /opt/disagg \
 && /opt/disagg/bin/pip install --upgrade pip \
 && /opt/disagg/bin/pip install . \
 && /opt/disagg/bin/python -c "import disagg_operator, disagg_sidecar, disagg_cli" \
 && ! /opt/disagg/bin/pip show vllm torch >/dev/null 2>&1

FROM python:3.11-slim
ENV PATH=/opt/disagg/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
RUN groupadd --system --gid 10001 disagg \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin disagg
COPY --from=build /opt/disagg /opt/disagg
# Numeric so `runAsNonRoot` can verify it without resolving names.
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["disagg"]
CMD ["--help"]
