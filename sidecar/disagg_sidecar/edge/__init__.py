"""The client's side of the sidecar: the HTTP server, the handlers that read and check a request
before any leg is sent (body size and JSON shape, API keys, the prefill host a scheduler names),
and nothing that talks to an upstream."""
