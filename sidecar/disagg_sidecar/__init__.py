"""Disagg sidecar: routes OpenAI / GenerateRequest traffic through render -> prefill -> decode -> derender.

Layers (each imports only the ones below it):
- ``commands`` (``disagg sidecar --config FILE``) > ``app`` (routes, middleware, one ClientSession)
  > ``handlers`` (thin: read, check, hand over) > ``flows`` (one request through the legs)
  > ``decoding`` (the decode leg, its refusal rule) / ``poollegs`` (render, derender, prefill)
  > ``clientstream`` (the client's SSE stream) > ``context`` (per request) / ``failures`` (failed
  legs as the client sees them) > ``upstream`` (legs on the wire, retries, aborts)
  > ``endpoints``/``discovery`` (which endpoint);
- pure decisions and shapes: ``plan`` (output mode, prefill route), ``capabilities`` (what the
  decode engine may be asked for), ``legs`` (per-leg bodies), ``connectors`` (KV params),
  ``allowlist`` (x-prefiller-host-port), ``streaming`` (SSE, chained derender with coalescing),
  ``responses``/``usage``/``derender_fixes`` (coupled response shapes);
- ``config`` (the file), ``wire`` (names), ``vllm_releases`` (the supported vLLM releases, also read
  by the operator and the engine extension), ``errors``, ``metrics``, ``logs``, ``state``, ``keys``.
Nothing here imports vLLM or torch.
"""
