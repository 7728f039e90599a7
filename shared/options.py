"""Options declared once, on the fields of a configuration dataclass: name, type, default, help and
choices. A program's flags (shared/option_flags.py), their PAGEDSERVE_* variables (shared/option_env.py)
and the command line that gives a child process the same values all derive from the declaration:

    @dataclass(frozen=True)
    class SchedulerOptions:
        drain_timeout: float = option(30.0, "seconds to let requests finish on stop")

is --drain-timeout (a float, 30 when not given), also read from PAGEDSERVE_DRAIN_TIMEOUT.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "PAGEDSERVE_"


def env_name(name: str) -> str:
    """The environment variable of an option (or an argparse destination): max_num_seqs ->
    PAGEDSERVE_MAX_NUM_SEQS."""
    return ENV_PREFIX + name.upper()


@dataclass(frozen=True)
class Option:
    """One option, as a field declares it with option(), completed with the field's name, type and default."""
    name: str
    kind: type  # bool: a switch (--x / --no-x); list: a repeatable flag; else the value's type
    default: Any
    help: str
    owner: type  # the dataclass that declares it: options of two owners are two options, whatever their names
    choices: tuple | None = None
    parse: Callable[[str], Any] | None = None  # the value from the flag's text (default: the kind's)
    render: Callable[[Any], str] = str  # the value as a flag's text, on a child's command line
    short: str | None = None  # a short flag beside the long one: "-tp"
    several: bool = False  # a list option taking several values after one flag (nargs="+"), not one per flag
    read_by: tuple[str, ...] = ()  # the programs besides its owner's that take it ("scheduler", "gateway")
    secret: bool = False  # given to a child in its environment: a command line is readable by anyone (ps)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return env_name(self.name)


def option(default: Any, help: str, **declared: Any) -> Any:
    """A dataclass field that is an option; declared takes Option's fields from choices on."""
    return dataclasses.field(default=default, metadata={"option": {"help": help, **declared}})


@functools.cache
def options_of(cls: type) -> tuple[Option, ...]:
    """The options a dataclass declares, in field order."""
    hints = typing.get_type_hints(cls)
    return tuple(Option(field.name, _kind(hints[field.name]), field.default, owner=cls, **field.metadata["option"])
                 for field in dataclasses.fields(cls) if "option" in field.metadata)


def option_named(cls: type, name: str) -> Option:
    return next(option for option in options_of(cls) if option.name == name)


def read_by(cls: type, program: str) -> tuple[Option, ...]:
    """The dataclass's options that another program takes too (the engine's limits, for the scheduler)."""
    return tuple(option for option in options_of(cls) if program in option.read_by)


def _kind(annotation: Any) -> type:
    """int for `int | None`, list for `list[str] | None`, bool for bool."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    return typing.get_origin(annotation) or annotation


def values(cls: type, args: Any) -> dict[str, Any]:
    """The dataclass's options, by name, as a parser read them (or any object with them as attributes);
    those the parser did not have are left out."""
    return {option.name: getattr(args, option.name) for option in options_of(cls) if hasattr(args, option.name)}


def from_args(cls: type, args: Any):
    """The dataclass, from what a parser read; options the parser did not have keep their defaults.
    Raises the dataclass's ValueError for a bad value."""
    return cls(**values(cls, args))


def refusal(cls: type, args: Any) -> str | None:
    """What the dataclass refuses in what a parser read, naming the flag ("--block-size must be a power of
    two, got 3"); None: nothing."""
    try:
        from_args(cls, args)
    except ValueError as exc:  # it names the field as Python does: "block_size must be ..."
        return "--" + str(exc).replace("_", "-")
    return None


def command_line(options: Iterable[Option], values: Any) -> list[str]:
    """The flags that give a program these options' values (read as attributes of values); an option at
    None is left to the program's default."""
    return [word for option in options for word in flag_words(option, getattr(values, option.name))]


def flag_words(option: Option, value: Any) -> list[str]:
    if value is None:
        return []
    if option.kind is bool:
        return [option.flag if value else "--no-" + option.flag[2:]]
    if option.kind is list:  # one flag per item
        return [word for item in value for word in _flag_and_text(option, option.render(item))]
    return _flag_and_text(option, option.render(value))


def _flag_and_text(option: Option, text: str) -> list[str]:
    """--flag text, or --flag=text where the text would read as a flag of its own ("--x", "-tp")."""
    return [f"{option.flag}={text}"] if text.startswith("-") else [option.flag, text]
