"""Every flag may also come from the environment: --max-num-seqs from PAGEDSERVE_MAX_NUM_SEQS. That is
how compose.yaml configures the services. A flag on the command line still wins."""

from __future__ import annotations

import argparse
import json
import os

from shared.options import env_name


def apply_env_defaults(parser: argparse.ArgumentParser) -> None:
    """Each flag's default from its variable, where that is set; a bad value ends the program with one line."""
    for action in parser._actions:  # argparse has no public way to list the options
        if not action.option_strings or action.dest == "help":
            continue
        variable = env_name(action.dest)
        raw = os.environ.get(variable)
        if raw is None or (not raw.strip() and _empty_is_unset(action)):
            continue
        parser.set_defaults(**{action.dest: _env_value(action, raw, variable)})


def _empty_is_unset(action: argparse.Action) -> bool:
    """compose passes an unset variable as '': the flag keeps its default, unless '' is a value of its own
    (free text whose default is not empty: --allowed-origins '' turns CORS off)."""
    return not (action.type is None and action.choices is None and isinstance(action.default, str) and action.default)


def _env_value(action: argparse.Action, raw: str, variable: str):
    """A flag's value from its variable, checked as argparse checks the flag (one clear line if wrong)."""
    if action.nargs == 0:  # a switch; the variable names the destination (ENABLE_CHUNKED_PREFILL=false)
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(action, argparse._AppendAction):
        if raw.strip().startswith("["):
            return _json_list(raw, variable)  # entries that may hold commas (JSON ones)
        return [item.strip() for item in raw.split(",") if item.strip()]
    try:
        value = action.type(raw) if action.type else raw
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise SystemExit(f"pagedserve: error: {variable}={raw!r} is not a valid {action.option_strings[0]}: {exc}") \
            from None
    if action.choices is not None and value not in action.choices:
        raise SystemExit(f"pagedserve: error: {variable}={raw!r}: {action.option_strings[0]} must be one of "
                         f"{', '.join(map(str, action.choices))}")
    return value


def _json_list(raw: str, variable: str) -> list[str]:
    """A list flag's value from a JSON list: strings as they are, objects as their JSON."""
    try:
        items = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"pagedserve: error: {variable} is not a valid JSON list: {exc}") from None
    if not isinstance(items, list):
        raise SystemExit(f"pagedserve: error: {variable} must be a JSON list")
    return [item if isinstance(item, str) else json.dumps(item) for item in items]
