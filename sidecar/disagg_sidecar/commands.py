"""``disagg sidecar --config FILE``: load the config, serve, drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from aiohttp import web
from pydantic import ValidationError

from disagg_sidecar.edge import auth
from disagg_sidecar.upstream import tls
from disagg_sidecar.app import build_app
from disagg_sidecar.config import CUT_SECONDS, SidecarConfig, load_config
from disagg_sidecar.keys import STATE
from disagg_sidecar.logs import setup_logging
from disagg_sidecar.edge.server import SidecarRunner

log = logging.getLogger("disagg_sidecar")


async def serve(config: SidecarConfig, stop: asyncio.Event) -> None:
    """Serve until ``stop`` is set, then: readiness off, new requests still served for
    ``limits.deregister_seconds`` (the pod is leaving its Services meanwhile), then in-flight
    requests get up to ``limits.drain_seconds`` to finish, then the rest are cancelled (their legs
    aborted). From ``stop`` on, every response closes its connection (clients reconnect elsewhere)."""
    app = build_app(config)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its legs.
    # The drain below is the grace period; shutdown only lets responses that just ended flush
    # (as aiohttp's own shutdown_timeout it would add a second drain_seconds to the deadline).
    runner = SidecarRunner(app, config, handler_cancellation=True, access_log=None, shutdown_timeout=CUT_SECONDS)
    await runner.setup()
    site = web.TCPSite(runner, config.listen.host, config.listen.port, reuse_address=True)
    await site.start()
    log.info("listening on %s:%d", config.listen.host, config.listen.port)
    try:
        await stop.wait()
        state = app[STATE]
        state.start_draining()
        if (window := config.limits.deregister_seconds) > 0:
            log.info("readiness off; serving new connections for %.0fs while endpoints are removed", window)
            await asyncio.sleep(window)  # a fixed window, as kubelet's preStop sleep: nothing to wait for
        log.info("draining %d in-flight requests (up to %.0fs)", state.in_flight, config.limits.drain_seconds)
        if not await state.wait_idle(config.limits.drain_seconds):
            log.warning("drain deadline reached with %d requests in flight", state.in_flight)
        state.drained.set()  # the engine's preStop hook returns: vLLM gets its SIGTERM
    finally:
        await runner.cleanup()


def sidecar_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="disagg sidecar", description="Run the Disagg routing sidecar.")
    parser.add_argument("--config", required=True, help="the sidecar configuration file (YAML)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        for key_file in (config.auth.engine_api_key_file, config.auth.client_api_key_file):
            if key_file:
                auth.read_key(key_file)  # unreadable or empty: refuse to start, naming the file
        tls.client_context(config)  # an unreadable CA bundle, likewise
    except (OSError, ValueError, ValidationError) as exc:
        print(f"disagg sidecar: invalid configuration {args.config}: {exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_level)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, stop)

    asyncio.run(main())
    return 0
