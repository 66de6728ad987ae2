"""The release table (disagg_sidecar.vllm_releases): version parsing, rows, the conservative row, README,
docs/protocol.md §1's table of differences."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from disagg_sidecar import vllm_releases as releases
from disagg_sidecar.config import EngineFeatures

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("version", "name"), [
    ("0.33.0", "0.33"), ("0.33.1rc1", "0.33"), ("0.32.0+cpu", "0.32"), ("v0.34.0", "0.34"), ("0.34", "0.34"),
    ("1.0.0", "1.0"), ("0.35.0.dev12+g1234", "0.35"), ("", None), (None, None), ("latest", None), ("0.x.1", None),
])
def test_a_release_is_major_minor(version: str | None, name: str | None) -> None:
    assert releases.release_name(version) == name


@pytest.mark.parametrize(("version", "streaming", "batch", "sessions", "window", "omits_none", "token_ids"), [
    ("0.32.0", False, False, True, "prev_tokens", False, False),
    ("0.33.0", False, True, True, "prev_tokens", False, False),
    ("0.34.0", True, True, False, "prev_token_ids", True, True),
])
def test_each_release_offers_what_its_sources_show(version: str, streaming: bool, batch: bool, sessions: bool,
                                                   window: str, omits_none: bool, token_ids: bool) -> None:
    row = releases.release(version)
    assert (row.stock_streaming_derender, row.stock_batch_derender, row.derender_sessions) == (streaming, batch, sessions)
    assert row.stream_state_key == window
    assert (row.omits_none_shapes, row.parse_context_token_ids) == (omits_none, token_ids)
    assert releases.supported(version)


@pytest.mark.parametrize("version", ["0.35.0", "1.0.0", "0.31.0", "nightly", None])
def test_a_version_outside_the_table_assumes_nothing(version: str | None) -> None:
    assert not releases.supported(version) and releases.known(version) is None
    assert not any(releases.features(version).values())
    assert releases.release(version).stream_state_key is None


def test_the_window_is_current_previous_and_the_main_lane() -> None:
    assert [r.name for r in releases.RELEASES] == ["0.32", "0.33", "0.34"]
    assert releases.NEWEST.label.startswith("current") and "main lane" in releases.OLDEST.label
    assert releases.with_feature("derender_sessions") == "vLLM 0.32, 0.33"


def test_readme_names_the_supported_releases_of_the_table() -> None:
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert releases.supported_line() in readme


def _protocol_differences() -> list[list[str]]:
    """docs/protocol.md §1's table of the vLLM differences Disagg handles, as rows of cells."""
    text = (ROOT / "docs" / "protocol.md").read_text()
    section = text[text.index("## 1. Processes and tiers"):text.index("## 2. ")]
    start = section.index("| | 0.32 |")
    lines = section[start:].split("\n\n", 1)[0].splitlines()
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines if not line.startswith("|---")]


def test_the_protocol_table_has_a_column_per_release_and_cites_what_exists() -> None:
    header, *rows = _protocol_differences()
    assert header == ["", *(r.name for r in releases.RELEASES), "Disagg"]
    assert rows and all(len(row) == len(header) for row in rows), [row[0] for row in rows if len(row) != len(header)]
    text = " ".join(cell for row in rows for cell in row)
    cited_fields = set(re.findall(r"release table `(\w+)`", text))
    cited_features = set(re.findall(r"feature `(\w+)`", text))
    assert cited_fields and cited_features
    assert cited_fields <= {f.name for f in dataclasses.fields(releases.Release)}
    assert cited_features <= set(EngineFeatures.model_fields)


# --- stream_state windows and parse_context across releases ---------------------------------------

WINDOW_033 = {"prev_tokens": ["▁Hel", "lo"], "prefix_offset": 0, "read_offset": 2}
WINDOW_034 = {"prev_token_ids": [9707, 385], "prefix_offset": 0, "read_offset": 2}


@pytest.mark.parametrize(("sent", "answered", "lost"), [
    (WINDOW_033, {**WINDOW_033, "prev_tokens": ["lo", "!"]}, False),  # the same release read it
    (WINDOW_034, {**WINDOW_034, "prev_token_ids": [385, 0]}, False),
    (WINDOW_033, {"prev_token_ids": [0], "prefix_offset": 0, "read_offset": 1}, True),  # 0.34 ignored 0.33's
    (WINDOW_034, {"prev_tokens": ["!"], "prefix_offset": 0, "read_offset": 1}, True),  # and the reverse
    (None, {"prev_token_ids": [0]}, False),  # the first call: no window to lose
    ({"prev_tokens": [], "prefix_offset": 0, "read_offset": 0}, {"prev_token_ids": [0]}, False),  # empty window
    ({"output_token_ids": [1, 2]}, {"output_token_ids": [1, 2, 3]}, False),  # the parser's replay state
    ([WINDOW_033, WINDOW_033], [{"prev_token_ids": [1]}, {"prev_token_ids": [2]}], True),  # per choice
    (WINDOW_033, None, False),
])
def test_a_window_read_by_another_release_is_detected(sent, answered, lost: bool) -> None:
    assert releases.window_lost(sent, answered) is lost


@pytest.mark.parametrize(("context", "version", "expected"), [
    ({"tools": None, "return_tokens_as_token_ids": True}, "0.34.0", {"tools": None, "return_tokens_as_token_ids": True}),
    ({"tools": None, "return_tokens_as_token_ids": None}, "0.33.0", {"tools": None}),  # unknown there: dropped
    ({"tools": None, "return_tokens_as_token_ids": True}, "0.33.0", None),  # cannot be honoured: no inline derender
    ({"tools": None, "return_tokens_as_token_ids": False}, "0.33.0", None),
    ({"tools": None}, "0.33.0", {"tools": None}),
    ({"tools": None, "return_tokens_as_token_ids": True}, "0.35.0", None),  # untested: nothing assumed
])
def test_parse_context_as_the_decode_release_reads_it(context: dict, version: str, expected: dict | None) -> None:
    assert releases.strip_parse_context(context, releases.release(version)) == expected
