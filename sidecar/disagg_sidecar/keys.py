"""Typed application state keys (aiohttp ``AppKey``): the app's only shared state."""

from __future__ import annotations

from aiohttp import web

from disagg_sidecar.upstream.enginemetrics import EngineMetrics
from disagg_sidecar.pipeline.flows import Flows
from disagg_sidecar.metrics import Metrics
from disagg_sidecar.state import SidecarState
from disagg_sidecar.tracing import Tracing
from disagg_sidecar.upstream.client import Upstream

STATE = web.AppKey("state", SidecarState)
METRICS = web.AppKey("metrics", Metrics)
UPSTREAM = web.AppKey("upstream", Upstream)
FLOWS = web.AppKey("flows", Flows)
SCRAPE = web.AppKey("scrape", EngineMetrics)
TRACING = web.AppKey("tracing", Tracing)
