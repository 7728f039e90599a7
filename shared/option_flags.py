"""Command-line flags from declared options (shared/options.py), and the parser every pagedserve
command uses: its errors are one line, its --help shows each flag's default."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from shared.options import Option


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, unless its text already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return text if "(default" in text or "default:" in text else super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """A usage error is one line and exit code 1: `pagedserve serve`'s usage alone is dozens of lines, which
    would bury the error."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(1, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, options: Iterable[Option]) -> None:
    """A flag per option (and its short form): --max-num-seqs for max_num_seqs."""
    for option in options:
        flags = (option.flag, option.short) if option.short else (option.flag,)
        parser.add_argument(*flags, dest=option.name, default=option.default, help=option.help,
                            **_how_to_read(option))


class _FlagReplacesDefault:
    """A list flag given replaces its default (values from the environment, shared/option_env.py) rather
    than adding to it: a flag given wins, as any other flag's does."""

    def __call__(self, parser, namespace, values, option_string=None):
        if self.default is not None and getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, None)
        super().__call__(parser, namespace, values, option_string)


class AppendFlag(_FlagReplacesDefault, argparse._AppendAction):
    """One value per flag, repeated for more."""


class ExtendFlag(_FlagReplacesDefault, argparse._ExtendAction):
    """Several values after one flag (and the flag repeated for more)."""


def _how_to_read(option: Option) -> dict:
    if option.kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if option.kind is list:
        return {"action": ExtendFlag, "nargs": "+", "type": option.parse} if option.several \
            else {"action": AppendFlag, "type": option.parse}
    parse = option.parse or (option.kind if option.kind in (int, float) else None)  # text stays text
    return {"type": parse, "choices": list(option.choices) if option.choices is not None else None}
