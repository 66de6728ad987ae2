"""Wire names shared by every sidecar module: paths, headers, JSON fields (defined once)."""

from typing import Final, Literal

OutputMode = Literal["tokens", "text", "derender"]
OUTPUT_MODES: Final = ("tokens", "text", "derender")
# How the decode leg carries the parser context for output mode "derender" (the field it goes in).
ContextForm = Literal["chat_request", "parse_context"]
# The APIs whose client chunks a decode stream can write (``client_stream.api``).
ClientStreamApi = Literal["chat", "completions"]
CLIENT_STREAM_APIS: Final = ("chat", "completions")

# vLLM scale-out paths.
CHAT_RENDER: Final = "/v1/chat/completions/render"
COMPLETIONS_RENDER: Final = "/v1/completions/render"
MESSAGES_RENDER: Final = "/v1/messages/render"
RESPONSES_RENDER: Final = "/v1/responses/render"
CHAT_DERENDER: Final = "/v1/chat/completions/derender"
COMPLETIONS_DERENDER: Final = "/v1/completions/derender"
GENERATE: Final = "/inference/v1/generate"
ABORT: Final = "/inference/v1/abort_requests"
CAPABILITIES: Final = "/disagg/v1/capabilities"
VERSION: Final = "/version"  # every vLLM server's {"version": ...}
DETOKENIZE: Final = "/detokenize"  # the render tier's: vLLM's renderer decodes token ids (echo)

# The engine extension's vLLM plugin name: in VLLM_PLUGINS, pyproject's `vllm.endpoint_plugins`
# entry point, and the `extension` its capabilities report.
ENGINE_EXTENSION: Final = "disagg"

# Inbound (OpenAI) and operational paths.
CHAT: Final = "/v1/chat/completions"
COMPLETIONS: Final = "/v1/completions"
MESSAGES: Final = "/v1/messages"  # Anthropic's Messages API: its errors are Anthropic's object
MESSAGES_COUNT_TOKENS: Final = "/v1/messages/count_tokens"
RESPONSES: Final = "/v1/responses"
MODELS: Final = "/v1/models"
HEALTH: Final = "/health"
LIVE: Final = "/health/live"
DRAINED: Final = "/health/drained"  # the decode engine's preStop hook (handlers.drained)
METRICS: Final = "/metrics"

# Headers.
REQUEST_ID: Final = "X-Request-Id"
PREFILLER_HOST_PORT: Final = "x-prefiller-host-port"
PREFILL_OUTCOME: Final = "x-disagg-prefill"
RENDER_OUTCOME: Final = "x-disagg-render"  # "decode": the decode engine answered itself (render.failure_policy)
TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
FORWARDED_HEADERS: Final = (TRACEPARENT, TRACESTATE)

# Values of the x-disagg-prefill response header ("failed": on the 503 of failure_policy fail).
PrefillOutcome = Literal["remote", "fallback", "skipped", "local", "failed"]

# Engine request ids: vLLM prefixes the X-Request-Id of a generate call with this.
GENERATE_ID_PREFIX: Final = "generate-tokens-"

# GenerateRequest fields the legs differ on.
KV_TRANSFER_PARAMS: Final = "kv_transfer_params"
SAMPLING_PARAMS: Final = "sampling_params"
EXTRA_ARGS: Final = "extra_args"
OUTPUT_MODE: Final = "output_mode"
CHAT_REQUEST: Final = "chat_request"
PARSE_CONTEXT: Final = "parse_context"
CLIENT_STREAM: Final = "client_stream"
TOKEN_IDS: Final = "token_ids"
REMOTE_PREFILL_CACHED_TOKENS: Final = "remote_prefill_cached_tokens"

SSE_DONE: Final = b"[DONE]"
# A derender session's event that is the client's own chunk carries the lines its choice had consumed
# in an SSE field of this name beside ``data`` (``disagg_engine.sessions``), so the data stays the chunk.
SESSION_FED: Final = "fed"
