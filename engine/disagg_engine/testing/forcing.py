"""A vLLM logits processor that makes the real engine emit a chosen continuation.

Loaded with ``--logits-processors disagg_engine.testing.forcing:ForcedOutput``. A request opts in
with ``vllm_xargs: {"forced_token_ids": [...]}`` (chat/completions; it reaches
``SamplingParams.extra_args`` directly or through ``/render``). At output position ``i`` every
logit but ``forced_token_ids[i]`` is set to -inf, so only the *choice* of token is forced:
tokenization, detokenization, stop handling, parsers and streaming stay vLLM's own. Past the end
of the list the model's own logits are used, so a test that wants a clean finish ends the list
with the EOS id. Logprobs are unaffected (vLLM computes them from the raw logits).

vLLM changed the processor interface in 0.34; ``ForcedOutput`` is the class the running vLLM
expects, one section per interface below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib.util import find_spec

import torch
from vllm.sampling_params import SamplingParams

FORCED_KEY = "forced_token_ids"


def forced_ids(params: SamplingParams) -> list[int] | None:
    ids = (params.extra_args or {}).get(FORCED_KEY)
    if not ids:
        return None
    return [int(i) for i in ids]


def forced_step(position: int, prompt_len: int) -> int:
    """The output index of the token sampled from the logits of the token at ``position``."""
    return position + 1 - prompt_len


def _host_view(lengths) -> Sequence[int]:
    """A per-slot length buffer on the host: the GPU runner's ``UvaBackedTensor`` keeps one as
    ``.np``; the standalone CPU runner's is a CPU tensor."""
    return lengths.np if hasattr(lengths, "np") else lengths.numpy()


# vLLM 0.32/0.33: the V1 interface (vllm.v1.sample.logits_processor, deleted in 0.34).
if find_spec("vllm.v1.sample.logits_processor") is not None:
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

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

# vLLM 0.34: the model runner V2 interface. Per-slot state is set in add_request (slots are
# recycled); apply sees every row of the batch and finds each row's output index from its position.
else:
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcessor

    class ForcedOutput(LogitsProcessor):  # type: ignore[no-redef]
        """Per-request forcing keyed on ``extra_args["forced_token_ids"]``."""

        def __init__(self, vllm_config, req_states) -> None:
            self.prompt_len = req_states.prompt_len
            self.forced: dict[int, list[int]] = {}

        @classmethod
        def validate_params(cls, sampling_params: SamplingParams) -> None:
            ids = (sampling_params.extra_args or {}).get(FORCED_KEY)
            if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
                raise ValueError(f"{FORCED_KEY} must be a list of token ids")

        def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
            ids = forced_ids(sampling_params)
            if ids is None:
                self.forced.pop(req_idx, None)
                return False
            self.forced[req_idx] = ids
            return True

        def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
            if not self.forced:
                return logits
            prompt_len = _host_view(self.prompt_len)
            positions = ctx.pos.tolist()
            for row, slot in enumerate(ctx.expanded_idx_mapping.tolist()):
                ids = self.forced.get(slot)
                if ids is None:
                    continue
                step = forced_step(positions[row], int(prompt_len[slot]))
                if step < len(ids):
                    logits[row] = float("-inf")
                    logits[row, ids[step]] = 0.0
            return logits
