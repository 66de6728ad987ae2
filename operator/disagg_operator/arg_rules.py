"""Rules for lists of vLLM arguments (model.engineArgs, pools.*.extraArgs), in CEL and in Python.

An argument is refused when vLLM's parser would read it as a reserved flag: the flag itself, an
alias or --no- form (listed in engine_args), or an abbreviation argparse expands (``--trust-remote``,
``-t`` for ``-tp``); and ``--config``. The API server's message names the argument and the flag,
through a CEL messageExpression that ``explain`` spells again in Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from disagg_operator import engine_args

_OWNED_REASON = "Disagg sets it from the spec; use the spec fields"
_SHARED_REASON = "every tier must agree on it; set it in model.engineArgs"
_FILE_REASON = "it reads flags from a file that these checks never see"


def cel_list(values: Iterable[str]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


def _cel_flag(arg: str) -> str:
    # engine_args.flag_name(): text before '=', before '.', with '_' read as '-'.
    return f"{arg}.split('=')[0].split('.')[0].replace('_', '-')"


def _cel_sets(flag: str, flags: Sequence[str]) -> str:
    # engine_args.forbidden_flag(...) is not None, given the flag's name: the flag, or a prefix of it
    # argparse would expand.
    return f"!({flag} in {cel_list(engine_args.NOT_A_FLAG)}) && {cel_list(flags)}.exists(b, b.startsWith({flag}))"


@dataclass(frozen=True)
class FlagRule:
    """A list of vLLM args that must not set (or alias, or abbreviate) any of ``flags``."""

    field: str  # camelCase field of the target
    label: str  # how messages name the field
    flags: tuple[str, ...]

    # The flag names are mapped once (`map`), not per reserved flag. `[x].map(v, ...)` names a value
    # for reuse: cel.bind compiles in rules but not where the API server checks schema defaults.
    def _flag_names(self) -> str:
        return f"self.{self.field}.map(a, {_cel_flag('a')})"

    def cel(self) -> str:
        # An unset list has no schema default (to keep stored objects small), hence has().
        return f"!has(self.{self.field}) || !{self._flag_names()}.exists(f, {_cel_sets('f', self.flags)})"

    def message_cel(self) -> str:
        flags = cel_list(self.flags)
        return (
            f"{self._flag_names()}.filter(f, {_cel_sets('f', self.flags)})"
            f".map(f, [f in {flags} ? f : {flags}.filter(b, b.startsWith(f))[0]].map(m, "
            f"'{self.label} must not set ' + f + (f == m ? '' : ' (an abbreviation of ' + m + ')') + ': ' + "
            f"(m in {cel_list(engine_args.FILE_FLAGS)} ? '{_FILE_REASON}' : "
            f"m in {cel_list(engine_args.SHARED_ONLY_FLAGS)} ? '{_SHARED_REASON}' : '{_OWNED_REASON}'))[0])[0]"
        )

    def valid(self, args: Iterable[str]) -> bool:
        return all(engine_args.forbidden_flag(a, self.flags) is None for a in args)

    def explain(self, args: Iterable[str]) -> str:
        arg, matched = next((a, m) for a in args if (m := engine_args.forbidden_flag(a, self.flags)))
        name = engine_args.flag_name(arg)
        reason = (_FILE_REASON if matched in engine_args.FILE_FLAGS
                  else _SHARED_REASON if matched in engine_args.SHARED_ONLY_FLAGS else _OWNED_REASON)
        return f"{self.label} must not set {name}{'' if name == matched else f' (an abbreviation of {matched})'}: {reason}"

