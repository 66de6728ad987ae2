"""vLLM's ExampleConnector: KV in files on a shared directory, found by a hash of the prompt.

No parameters either way: an engine looks for a folder named after a hash of the first
``align(len(prompt) - 1)`` prompt tokens, where ``align(n) = (n - 1) // block_size * block_size``
(vLLM's ``example_connector.align_to_block_size``), and writes the folder of
``align(len(prompt))`` tokens for every prompt it computes without a match. Two consequences:

- every prompt of at most ``block_size + 1`` tokens looks up the same folder, the empty prefix,
  so a short prompt finds "KV" that another short prompt left and loads nothing useful;
- a one-token prompt aligns to ``-block_size``: an engine that finds the empty-prefix folder
  reports a negative number of matched tokens, which kills its EngineCore (``IndexError`` in the
  model runner) or its output handler (a negative Prometheus counter).

vLLM's class also ignores ``kv_role`` (a ``kv_consumer`` writes folders too). Hence the roles are
one-way (prefill writes, decode reads) and the engines load ``ENGINE_MODULE``'s subclass, which
makes the roles real and never reports a negative match; and only prompts of at least
``block_size + 2`` tokens go to a prefill engine: the shortest whose folder is a full block of
real tokens that decode looks up again (shorter ones would be prefilled twice for nothing).
"""

from __future__ import annotations

from collections.abc import Mapping

from disagg_sidecar.connectors.base import PrefilledAt, SideChannel


class ExampleConnector:
    name = "ExampleConnector"
    summary: str | None = "shared storage"
    kv_roles: Mapping[str, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}
    runs_locally = True  # a local directory is a shared storage path
    # vLLM's ``kv_connector_module_path``: needs the disagg package in the engine image.
    engine_module: str | None = "disagg_engine.kv_example"
    shared_path_key: str | None = "shared_storage_path"  # the engines' folder of KV files
    side_channel: SideChannel | None = None

    def prefill_params(self) -> None:
        return None

    def decode_params(self, prefill_response_params: object, prefilled: PrefilledAt) -> None:
        return None  # nothing of the prefill's answer reaches decode: the folder name is the prompt's hash

    def min_prompt_tokens(self, block_size: int) -> int:
        return block_size + 2
