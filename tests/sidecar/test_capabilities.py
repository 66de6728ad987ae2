"""What the decode engine may be asked for: from the configuration, stock vLLM of the engine's
version, and what the engine serves (pure)."""

from __future__ import annotations

import pytest

from disagg_sidecar import vllm_releases
from disagg_sidecar.plan import capabilities
from disagg_sidecar.config import Capabilities, SidecarConfig

ALL = ("tokens", "text", "derender")
EXT = Capabilities(output_modes=ALL, streaming_output_modes=ALL)
STOCK = Capabilities()  # tokens, text
STOCK_033 = Capabilities(output_modes=ALL, derender_context_forms=("parse_context",))
FEATURES_033 = {"generate_output_mode_derender": True, "render_parse_context": True}


def config(**overrides) -> SidecarConfig:
    return SidecarConfig.model_validate({"decode": {"url": "http://127.0.0.1:8200"}, **overrides})


@pytest.mark.parametrize("served, expected_modes, expected_stream", [
    (None, ALL, ALL),  # not asked yet: configuration
    ("absent", ("tokens", "text"), ("tokens", "text")),  # stock vLLM 0.32
    ({"output_modes": ["tokens", "text", "derender"], "streaming_output_modes": ["tokens", "text"]},
     ALL, ("tokens", "text")),
    ({"output_modes": ["tokens"]}, ("tokens",), ALL),
])
def test_effective(served, expected_modes, expected_stream) -> None:
    caps = capabilities.effective(EXT, served)
    assert caps.output_modes == expected_modes and caps.streaming_output_modes == expected_stream


def test_absent_extension_leaves_what_stock_vllm_of_that_version_does() -> None:
    caps = capabilities.effective(EXT, "absent", STOCK_033)
    assert caps.output_modes == ALL and caps.streaming_output_modes == ("tokens", "text")
    assert caps.derender_context_forms == ()  # EXT (configured) only named chat_request


@pytest.mark.parametrize("served, expected", [
    ({"client_streams": ["chat", "completions"]}, ("chat", "completions")),
    ({"client_streams": ["completions", "chat", "responses"]}, ("chat", "completions")),  # one it does not know
    ({"client_streams": ["completions"]}, ("completions",)),
    ({"client_streams": True}, ("chat",)),  # the first extension's word: chat's chunks alone
    ({"client_streams": []}, ()),
    ({"client_streams": "yes"}, ()),
    ({"client_streams": "chat"}, ()),
    ({"client_streams": [True, 1]}, ()),
    ({}, ()),  # an extension from before client streams
    ("absent", ()),  # stock vLLM writes generate chunks
])
def test_client_streams_only_where_the_engine_says_it_writes_them(served, expected) -> None:
    assert capabilities.effective(capabilities.EXTENSION, served, STOCK_033).client_streams == expected
    assert capabilities.effective(STOCK, {"client_streams": ["chat", "completions"]}).client_streams == ()  # configured off
    chat_only = capabilities.EXTENSION.model_copy(update={"client_streams": ("chat",)})
    assert capabilities.effective(chat_only, served).client_streams == tuple(a for a in expected if a == "chat")


@pytest.mark.parametrize("configured, expected", [
    (True, ("chat",)), (False, ()), (["completions"], ("completions",)), ([], ()),
])
def test_configured_client_streams_take_the_first_extensions_booleans(configured, expected) -> None:
    assert Capabilities.model_validate({"client_streams": configured}).client_streams == expected


def test_configured_client_streams_name_known_apis() -> None:
    with pytest.raises(ValueError, match="client_streams"):
        Capabilities.model_validate({"client_streams": ["responses"]})


def test_configuration_only_narrows() -> None:
    served = {"output_modes": list(ALL), "streaming_output_modes": list(ALL), "parser_configured": False,
              "derender_context_forms": ["chat_request", "parse_context"]}
    caps = capabilities.effective(STOCK, served)
    assert caps.output_modes == ("tokens", "text") and caps.parser_configured is False
    assert caps.derender_context_forms == ("chat_request",)


@pytest.mark.parametrize("engine, expected", [
    ({}, STOCK),  # vLLM 0.32: tokens and text on generate
    ({"features": FEATURES_033}, STOCK_033),
    ({"features": {"generate_output_mode_derender": True}}, STOCK),  # derender needs render's parse_context
    ({"extension": True}, Capabilities(output_modes=ALL, streaming_output_modes=ALL,
                                       derender_context_forms=("chat_request", "parse_context"),
                                       client_streams=("chat", "completions"))),
    ({"extension": True, "features": FEATURES_033}, capabilities.EXTENSION),
])
def test_configured_from_the_engine(engine, expected) -> None:
    assert capabilities.configured(config(engine=engine)) == expected


def test_configured_capabilities_win_over_the_engine() -> None:
    given = {"output_modes": ["tokens"], "streaming_output_modes": ["tokens"]}
    c = config(decode={"url": "http://127.0.0.1:8200", "capabilities": given}, engine={"extension": True})
    assert capabilities.configured(c) == Capabilities(output_modes=("tokens",), streaming_output_modes=("tokens",))


def test_stock_is_the_engines_version_without_the_extension() -> None:
    c = config(engine={"extension": True, "features": FEATURES_033})
    assert capabilities.stock(c.engine) == STOCK_033
    assert capabilities.current(c, "absent").streaming_output_modes == ("tokens", "text")


@pytest.mark.parametrize(("reported", "batch_derender"), [
    (None, True), ("0.33.1", True), ("0.34.0", True), ("0.32.0", False), ("0.35.0", False)])
def test_stock_is_narrowed_by_the_release_the_engine_reports(reported: str | None, batch_derender: bool) -> None:
    """The configuration says 0.33; the engine's own /version decides once it answered (an untested
    release: nothing assumed)."""
    c = config(engine={"features": FEATURES_033})
    release = None if reported is None else vllm_releases.release(reported)
    assert (capabilities.stock(c.engine, release) == STOCK_033) is batch_derender
    assert ("derender" in capabilities.current(c, "absent", release).output_modes) is batch_derender


def test_current_ignores_the_probe_unless_asked_to() -> None:
    served = {"output_modes": ["tokens"], "streaming_output_modes": ["tokens"]}
    probing = config(engine={"extension": True})
    assert capabilities.current(probing, served).output_modes == ("tokens",)
    assert capabilities.current(probing, None) == capabilities.EXTENSION
    trusting = config(decode={"url": "http://127.0.0.1:8200", "probe_capabilities": False}, engine={"extension": True})
    assert capabilities.current(trusting, served) == capabilities.EXTENSION


def test_served_drops_gauges_only() -> None:
    answer = {"output_modes": ["tokens"], "live_derender_requests": 3}
    assert capabilities.served(answer) == {"output_modes": ["tokens"]}
    assert answer["live_derender_requests"] == 3  # the probe's answer is not changed
    assert capabilities.served("absent") == "absent" and capabilities.served(None) is None


FEATURES_034 = {**FEATURES_033, "generate_streaming_derender": True}
STOCK_034 = Capabilities(output_modes=ALL, streaming_output_modes=ALL, derender_context_forms=("parse_context",))


@pytest.mark.parametrize(("reported", "expected"), [
    (None, STOCK_034), ("0.34.0", STOCK_034), ("0.33.1", STOCK_033), ("0.32.0", STOCK), ("0.35.0", STOCK)])
def test_a_stock_034_decode_streams_derender_itself_while_it_reports_034(reported: str | None,
                                                                         expected: Capabilities) -> None:
    """Configured for 0.34 (the operator's features): stock streaming derender with render's
    parse_context, until the engine's /version names a release without it (a 0.33 pod during a
    rollout: batch only; 0.32 or an untested release: nothing)."""
    c = config(engine={"features": FEATURES_034})
    release = None if reported is None else vllm_releases.release(reported)
    assert capabilities.stock(c.engine, release) == expected
    caps = capabilities.current(c, "absent", release)
    assert caps.streaming_output_modes == expected.streaming_output_modes


def test_the_operator_configures_what_the_release_table_says() -> None:
    """The operator's features per version are the keys the sidecar reads (an unknown key would be ignored)."""
    from disagg_operator.engine_args import vllm_features
    from disagg_sidecar.config import EngineFeatures

    for version, expected in (("0.32.0", STOCK), ("0.33.0", STOCK_033), ("0.34.0", STOCK_034), ("0.35.0", STOCK)):
        features = vllm_features(version)
        assert set(features) <= set(EngineFeatures.model_fields)
        assert capabilities.configured(config(engine={"features": features})) == expected


def test_the_state_computes_capabilities_again_only_when_a_probe_brings_news() -> None:
    from disagg_sidecar.state import SidecarState

    state = SidecarState(config(engine={"extension": True, "features": FEATURES_033}))
    first = state.capabilities()
    assert state.capabilities() is first  # nothing new: the same object, no per-request work
    state.served_capabilities = {"output_modes": ["tokens"], "streaming_output_modes": ["tokens"]}
    narrowed = state.capabilities()
    assert narrowed.output_modes == ("tokens",) and narrowed is not first
    state.served_capabilities = dict(state.served_capabilities, output_modes=["tokens", "text"])  # a new answer
    assert state.capabilities().output_modes == ("tokens", "text")
    # The engine has no extension: stock vLLM of the configured 0.33 derenders a batch, until the
    # engine reports 0.32, whose stock vLLM does not.
    state.served_capabilities = "absent"
    assert "derender" in state.capabilities().output_modes
    state.decode_version = "0.32.0"
    assert "derender" not in state.capabilities().output_modes
