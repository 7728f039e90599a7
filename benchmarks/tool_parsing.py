"""What reading tool calls out of a stream (tool_choice "auto") costs the gateway per delta.

Each parser reads the same outputs in deltas of --delta-chars characters: plain text (no calls), a
long call, and text with calls in it. Reported: the best of --repeats runs, in CPU microseconds per
delta (the gateway spends about 70 per streamed token on everything else: RESULTS.md, "Gateway").

    python benchmarks/tool_parsing.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import write_report  # noqa: E402
from services.gateway.tool_parsers import TOOL_CALL_PARSERS, ToolCallParser  # noqa: E402


def outputs(parser: str, size: int) -> dict[str, str]:
    plain = ("An answer in prose, with a < sign and braces {like these} now and then. " * size)[:60 * size]
    arguments = json.dumps({"query": "x" * (40 * size), "limit": 10})
    if parser == "hermes":
        call = f'<tool_call>\n{{"name": "search", "arguments": {arguments}}}\n</tool_call>'
        mixed = f"{plain[:len(plain) // 2]}\n{call}\n{call}"  # after text
    else:
        call = f'{{"name": "search", "parameters": {arguments}}}'
        mixed = f"{call}; {call}"  # llama3_json: an output is calls or text, not both
    return {"plain text": plain, "one long call": call, "two calls": mixed}


def cpu_us_per_delta(parser: ToolCallParser, text: str, delta_chars: int, repeats: int) -> float:
    deltas = [text[i:i + delta_chars] for i in range(0, len(text), delta_chars)]
    best = float("inf")
    for _ in range(repeats):
        stream = parser.stream()
        start = time.process_time()
        for delta in deltas:
            stream.feed(delta)
        stream.finish()
        best = min(best, time.process_time() - start)
    return 1e6 * best / len(deltas)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=100, help="output length, in units of ~60 characters")
    parser.add_argument("--delta-chars", type=int, default=4, help="characters per delta (about a token)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "tool_parsing.json"))
    args = parser.parse_args()
    rows = []
    for name in TOOL_CALL_PARSERS:
        for (kind, text), calls in zip(outputs(name, args.size).items(), (0, 1, 2)):
            found = len(ToolCallParser(name).stream().parse(text).calls)
            if found != calls:  # a benchmark of a parser that reads nothing would mean nothing
                raise SystemExit(f"{name} found {found} calls in the {kind} output, not {calls}")
            us = cpu_us_per_delta(ToolCallParser(name), text, args.delta_chars, args.repeats)
            rows.append({"parser": name, "output": kind, "chars": len(text), "cpu_us_per_delta": us})
            print(f"{name:12} {kind:13} {len(text):7} chars  {us:6.2f} CPU µs per delta", file=sys.stderr)
    report = {"delta_chars": args.delta_chars, "repeats": args.repeats, "rows": rows}
    print(json.dumps(report, indent=2))
    write_report(args.out, report)


if __name__ == "__main__":
    main()
