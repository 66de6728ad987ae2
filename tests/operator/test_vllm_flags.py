"""The reserved engine flags against vLLM's own command-line parser (the one `vllm serve` and
`vllm launch render` build): every spelling that parser accepts for a reserved flag — aliases,
--no- forms, and the abbreviations argparse expands — is refused, and no other flag is.

Builds the real parser (imports vLLM: some seconds), no server.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from disagg_operator import engine_args
from disagg_operator.engine_args import forbidden_flag

RESERVED = engine_args.OWNED_FLAGS + engine_args.SHARED_ONLY_FLAGS + engine_args.FILE_FLAGS


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def reserved_actions(parser: argparse.ArgumentParser) -> set[argparse.Action]:
    return {a for a in parser._actions if set(a.option_strings) & set(RESERVED)}


def resolve(parser: argparse.ArgumentParser, arg: str) -> argparse.Action | None | str:
    """What argparse makes of an option argument: its action, None (unknown) or "ambiguous"."""
    name = arg.split("=", 1)[0]
    if name in parser._option_string_actions:
        return parser._option_string_actions[name]
    matches = {t[0] for t in parser._get_option_tuples(arg)}  # 3- or 4-tuples, action first
    return matches.pop() if len(matches) == 1 else ("ambiguous" if matches else None)


def prefixes(option: str) -> Iterator[str]:
    dashes = len(option) - len(option.lstrip("-"))
    return (option[:end] for end in range(dashes + 1, len(option) + 1))


def test_every_reserved_flag_is_a_vllm_flag(parser: argparse.ArgumentParser) -> None:
    assert [f for f in RESERVED if f not in parser._option_string_actions] == []


def test_every_spelling_of_a_reserved_flag_is_reserved(parser: argparse.ArgumentParser) -> None:
    """Aliases (-asc, -ep) and --no- forms set the same dest: they must be listed too."""
    missing = sorted(s for a in reserved_actions(parser) for s in a.option_strings if s not in RESERVED)
    assert missing == []


def test_abbreviations_argparse_expands_to_a_reserved_flag_are_refused_and_no_others(
        parser: argparse.ArgumentParser) -> None:
    reserved = reserved_actions(parser)
    options = sorted({s for a in parser._actions for s in a.option_strings})
    let_through, refused_wrongly, checked = [], [], 0
    for option in options:
        for prefix in prefixes(option):
            target = resolve(parser, prefix)
            if target in (None, "ambiguous"):  # vLLM refuses to start: either answer is safe
                continue
            checked += 1
            for spelling in (prefix, f"{prefix}=1", f"{prefix}.key=1"):
                refused = forbidden_flag(spelling, RESERVED) is not None
                if target in reserved and not refused:
                    let_through.append(spelling)
                if target not in reserved and refused:
                    refused_wrongly.append(f"{spelling} (vLLM reads {target.option_strings[0]})")
    assert let_through == []
    assert refused_wrongly == []
    assert checked > 1000, checked  # the walk really covered vLLM's options


@pytest.mark.parametrize("arg", ["--trust-remote", "--kv-transfer-conf=x", "--tool-call-pars=hermes", "--config=f.yaml",
                                 "-t", "-as", "-e", "--no-enable-sc", "--kv_transfer_conf.kv_role=x"])
def test_the_abbreviations_from_issue_17_reach_a_reserved_flag_in_vllm(parser: argparse.ArgumentParser,
                                                                        arg: str) -> None:
    # vLLM maps '_' to '-' in a flag's name and folds `--flag.key=v` into `--flag`; then argparse.
    name = engine_args.flag_name(arg)
    assert resolve(parser, name) in reserved_actions(parser)
    assert forbidden_flag(arg, RESERVED) is not None
