"""The release table (disagg_sidecar.vllm_releases): version parsing, rows, the conservative row, README."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg_sidecar import vllm_releases as releases

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
    assert releases.NEWEST.label == "current" and "main lane" in releases.OLDEST.label
    assert releases.with_feature("derender_sessions") == "vLLM 0.32, 0.33"


def test_readme_names_the_supported_releases_of_the_table() -> None:
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert releases.supported_line() in readme
