"""vLLM's ExampleConnector with the two guarantees Disagg's plan relies on (vLLM 0.32 and 0.33).

Loaded by the engines through ``kv_connector_module_path`` (``disagg_sidecar.connectors.example``
explains the folder arithmetic). vLLM's class ignores ``kv_role``: a decode engine planned as
``kv_consumer`` still writes a KV folder for every prompt it computes, and any engine that finds
the empty-prefix folder (written for any prompt of at most ``block_size`` tokens) reports a
negative match for a one-token prompt, or for a ``k * block_size + 1``-token prompt that its own
prefix cache already holds: the EngineCore dies (``IndexError`` in the model runner) or the output
handler does (a negative Prometheus counter). Here:

- a ``kv_consumer`` never writes and a ``kv_producer`` never loads (the roles mean what they say);
- the number of matched tokens is never negative (a match that adds nothing is no match).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector as _VLLMExampleConnector,
)


class ExampleConnector(_VLLMExampleConnector):
    """Same name as vLLM's: the factory looks the class up by ``kv_connector`` in this module."""

    def _transfer_role(self) -> str | None:
        return self._kv_transfer_config.kv_role

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._transfer_role() == "kv_producer":
            return 0, False
        matched, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if matched is not None and matched <= 0:
            return 0, False
        return matched, load_async

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if self._transfer_role() == "kv_consumer":
            meta.requests = [r for r in meta.requests if not r.is_store]
        return meta
