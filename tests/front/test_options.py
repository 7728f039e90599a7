"""Options declared once on dataclass fields (shared/options.py): the flags, the PAGEDSERVE_* variables
and a child's command line derived from them agree with the declaration and with each other."""

from __future__ import annotations

import argparse
import collections
from dataclasses import dataclass

import pytest

from shared.config import EngineConfig
from shared.option_env import apply_env_defaults
from shared.option_flags import ArgumentParser, add_options
from shared.options import command_line, from_args, option, options_of, refusal, values


@dataclass(frozen=True)
class Toy:
    count: int = option(2, "how many", short="-n")
    ratio: float | None = option(None, "a share")
    mode: str = option("a", "which", choices=("a", "b"))
    text: str = option("x", "free text")
    switch: bool = option(True, "on or off")
    each: list[str] | None = option(None, "one per flag")
    several: list[str] | None = option(None, "several after one flag", several=True)
    upper: str | None = option(None, "kept upper-case", parse=str.upper, render=str.lower)


def toy_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="toy")
    add_options(parser, options_of(Toy))
    return parser


def test_each_kind_of_option_reads_as_declared():
    assert from_args(Toy, toy_parser().parse_args([])) == Toy()
    args = toy_parser().parse_args(["-n", "5", "--ratio", "0.5", "--mode", "b", "--text", "", "--no-switch",
                                    "--each", "p", "--each", "q", "--several", "r", "s", "--upper", "up"])
    assert from_args(Toy, args) == Toy(5, 0.5, "b", "", False, ["p", "q"], ["r", "s"], "UP")


def test_a_command_line_gives_a_child_the_same_values():
    for argv in ([], ["--count", "0", "--no-switch", "--several", "a", "b", "--upper", "x"],
                 ["--ratio", "1e-3", "--each=--x", "--each", "y z", "--switch", "--text=-t", "-n", "-1"]):
        read = toy_parser().parse_args(argv)
        again = toy_parser().parse_args(command_line(options_of(Toy), read))
        assert values(Toy, again) == values(Toy, read), argv
    assert command_line(options_of(Toy), Toy()) == ["--count", "2", "--mode", "a", "--text", "x", "--switch"]


def test_the_environment_gives_defaults_and_a_flag_wins(monkeypatch):
    for name, value in [("COUNT", "7"), ("SWITCH", "false"), ("SEVERAL", "a, b"), ("EACH", '["c,d", {"e": 1}]'),
                        ("UPPER", "low"), ("RATIO", "")]:
        monkeypatch.setenv(f"PAGEDSERVE_{name}", value)
    parser = toy_parser()
    apply_env_defaults(parser)
    read = from_args(Toy, parser.parse_args(["--several", "z"]))
    assert read == Toy(count=7, switch=False, several=["z"], each=["c,d", '{"e": 1}'], upper="LOW")
    for name, value, expected in [("COUNT", "many", "PAGEDSERVE_COUNT='many' is not a valid --count"),
                                  ("MODE", "c", "--mode must be one of a, b")]:
        monkeypatch.setenv(f"PAGEDSERVE_{name}", value)
        with pytest.raises(SystemExit, match=expected):
            apply_env_defaults(toy_parser())
        monkeypatch.delenv(f"PAGEDSERVE_{name}")


def test_a_usage_error_is_one_line_and_exit_code_1(capsys):
    with pytest.raises(SystemExit) as exited:
        toy_parser().parse_args(["--mode", "c"])
    assert exited.value.code == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_a_refused_value_names_its_flag():
    assert refusal(EngineConfig, argparse.Namespace(block_size=3)) == "--block-size must be a power of two, got 3"
    assert refusal(EngineConfig, argparse.Namespace(max_num_seqs=4, watermark=0.5)) is None


def test_every_option_is_declared_once():
    """A name two services declare is two different options (the gateway's --drain-timeout is not the
    scheduler's); any other repeat would be a second declaration of one option."""
    from pagedserve.serve_flags import LauncherOptions
    from services.gateway.options import GatewayOptions
    from services.scheduler.options import SchedulerOptions
    from services.worker.options import WorkerOptions
    from shared.tracing import TracingOptions

    declared = [option for cls in (EngineConfig, GatewayOptions, SchedulerOptions, WorkerOptions, LauncherOptions,
                                   TracingOptions)
                for option in options_of(cls)]
    repeated = sorted(name for name, count in collections.Counter(o.name for o in declared).items() if count > 1)
    assert repeated == ["connect_timeout", "drain_timeout", "listen"]
    for option in declared:
        assert option.help and (option.kind in (bool, int, float, str, list) or option.parse), option.name


def test_every_engine_field_is_an_option():
    assert [option.name for option in options_of(EngineConfig)] == list(EngineConfig.__dataclass_fields__)


def test_serve_gives_every_child_the_tracing_endpoint_from_one_flag():
    from pagedserve.launcher import build_parser

    serve = build_parser()
    args = serve.parse_args(["--otlp-traces-endpoint", "http://collector:4317"])
    for child in ("worker", "scheduler", "gateway"):
        argv = serve.argv_for(child, args)
        assert argv[argv.index("--otlp-traces-endpoint") + 1] == "http://collector:4317", child
    assert not any("otlp" in word for child in ("worker", "scheduler", "gateway")
                   for word in serve.argv_for(child, serve.parse_args([])))
    groups = [group.title for group in serve._action_groups
              if any(action.dest == "otlp_traces_endpoint" for action in group._group_actions)]
    assert groups == ["every service (gateway, scheduler and workers)"]
