"""Disagg sidecar: routes OpenAI / Anthropic Messages / GenerateRequest traffic through render -> prefill ->
decode -> derender.

Layers, each importing only those below it (an import-linter contract in pyproject.toml):
- ``commands`` (``disagg sidecar --config FILE``) > ``app`` (routes, middleware, background
  probes, one ClientSession);
- ``edge/``: ``server`` (what aiohttp decides before a handler), ``handlers`` (read, check, hand
  over), ``auth`` (engine and client keys), ``bodycheck`` (size and JSON shape), ``allowlist``
  (``x-prefiller-host-port``);
- ``keys`` (the app's typed keys: its only shared state) > ``state`` (health, drain, budget);
- ``pipeline/``: ``flows`` (one request through the legs) > ``decoding`` (the decode leg) /
  ``poollegs`` (render, derender, prefill) > ``clientstream`` (the client's SSE stream) >
  ``context`` (per request) / ``failures`` (failed legs as the client sees them);
- ``derender/``: ``chained`` (tokens answers made into the client's), ``sessions`` (derender
  sessions), ``stream`` (per-chunk chained derender, coalescing), ``window`` (a stream's calls
  answered by render pods of two releases), ``shapes`` / ``usage`` /
  ``fixes`` (the coupled response shapes), ``anthropic`` (the Messages API as vLLM maps it onto chat);
- ``upstream/``: ``client`` (legs on the wire, retries, aborts), ``reading`` (an answer read off the
  wire: bounded, budgeted, watched for silence), ``endpoints`` / ``affinity``
  (which endpoint), ``discovery`` / ``endpointslices`` / ``kubeapi`` (where they are), ``tls``,
  ``enginemetrics`` / ``exposition`` (the decode engine's ``/metrics``);
- ``plan/`` (pure): ``request`` (one ``RequestPlan`` per request, read by the layers above),
  ``capabilities``, ``decisions``, ``requestlimits``, ``stops`` (stop strings and tokens), ``legs``,
  ``options`` (each request field carried or refused), ``answers`` (upstream answers checked),
  ``anthropic_request`` (a Messages request as the chat request vLLM derives);
- the base: ``config`` (the file), ``wire`` (names), ``vllm_releases`` (the supported vLLM releases,
  also read by the operator and the engine extension), ``errors``, ``metrics``, ``logs``, ``tracing``
  (spans of a request and its legs, OTLP), ``budget``,
  ``sse`` (event framing, compact JSON), ``connectors/``.
Nothing here imports vLLM or torch.
"""
