"""The `pagedserve` command."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from shared.config import EngineConfig
from shared.option_flags import ArgumentParser, add_options
from shared.options import option_named, options_of, values


def progress(message: str) -> None:
    """A phase of a long command, on stderr (stdout carries its results)."""
    print(f"pagedserve: {message}", file=sys.stderr, flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedserve.preflight import model_error, resolve_hub_ids

    if (error := resolve_hub_ids(args) or model_error(args)) is not None:
        raise ValueError(error)
    progress("importing the engine")
    from pagedserve import LLM, SamplingParams

    options = values(EngineConfig, args)
    model = options.pop("model")
    progress(f"loading {model or 'the built-in model (random weights: its text is gibberish)'}; a first run also "
             "makes the built-in model and builds the C++ CPU kernels, both cached")
    started = time.monotonic()
    llm = LLM(model, **options)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.sampling_seed)
    prompts = args.prompt or ["Hello, my name is", "The capital of France is"]
    progress(f"loaded in {time.monotonic() - started:.1f} s; generating for {len(prompts)} prompt(s)")
    started = time.monotonic()
    show_bar = sys.stderr.isatty()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=show_bar)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=show_bar)
    progress(f"generated in {time.monotonic() - started:.2f} s")
    for prompt, out in zip(prompts, outputs):
        print(json.dumps({"prompt": prompt, "text": out.outputs[0].text, "token_ids": out.outputs[0].token_ids,
                          "finish_reason": out.outputs[0].finish_reason}, ensure_ascii=False))
    print(json.dumps({"stats": llm.stats()}), file=sys.stderr)
    return 0


def cmd_api_keys(args: argparse.Namespace) -> int:
    """Make, list and revoke the API keys a gateway with --api-key-store accepts."""
    import asyncio

    from services.gateway.api_keys import RedisKeyStore, redacted_url

    async def run() -> int:
        store = RedisKeyStore(args.store, args.prefix)
        try:
            if args.action == "create":
                key, record = await store.create(args.name, args.requests_per_minute, args.tokens_per_minute)
                print(json.dumps({"name": record.name, "key": key, "requests_per_minute": record.requests_per_minute,
                                  "tokens_per_minute": record.tokens_per_minute}))
                print("the key is shown only now: the store keeps its hash", file=sys.stderr)
            elif args.action == "list":
                for record, created in await store.list():
                    print(json.dumps({"name": record.name, "key_sha256": record.key_id[:16],
                                      "requests_per_minute": record.requests_per_minute,
                                      "tokens_per_minute": record.tokens_per_minute, "created": created}))
            elif not await store.revoke(args.name):
                raise ValueError(f"no key is named {args.name!r}")
        finally:
            await store.close()
        return 0

    try:
        return asyncio.run(run())
    except Exception as exc:
        if isinstance(exc, OSError) or type(exc).__module__.startswith("redis"):  # redis.exceptions.ConnectionError
            raise ValueError(f"cannot reach the key store at {redacted_url(args.store)}: {exc}") from exc
        raise


def add_api_keys_command(commands) -> None:
    from services.gateway.options import GatewayOptions

    keys = commands.add_parser("api-keys", help="make, list and revoke API keys in the Redis key store")
    # The gateways' own options say where the keys are: their variables serve here too.
    gateway_store = option_named(GatewayOptions, "api_key_store")
    gateway_prefix = option_named(GatewayOptions, "api_key_store_prefix")
    store = argparse.ArgumentParser(add_help=False)  # --store, after the action as before it
    store.add_argument("--store", default=os.environ.get(gateway_store.env, "redis://127.0.0.1:6379/0"),
                       help=f"Redis URL of the key store (default: ${gateway_store.env}, else the local Redis)")
    store.add_argument("--prefix", default=os.environ.get(gateway_prefix.env, gateway_prefix.default),
                       help=f"the gateways' {gateway_prefix.flag}")
    actions = keys.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="make a key and print it (once)", parents=[store])
    create.add_argument("name", help="a unique name for the key (who holds it)")
    create.add_argument("--requests-per-minute", "--rpm", type=int, default=None)
    create.add_argument("--tokens-per-minute", "--tpm", type=int, default=None,
                        help="prompt plus completion tokens")
    actions.add_parser("list", help="every key's name, limits and hash prefix (never the key)", parents=[store])
    revoke = actions.add_parser("revoke", help="stop a key at once, on every gateway", parents=[store])
    revoke.add_argument("name")
    keys.set_defaults(func=cmd_api_keys)


SERVICES = {
    "serve": "pagedserve.launcher",
    "gateway": "services.gateway.server",
    "scheduler": "services.scheduler.server",
    "worker": "services.worker.server",
}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="pagedserve", description="LLM serving with PagedAttention")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate offline for a few prompts and print JSON lines")
    add_options(generate, options_of(EngineConfig))
    generate.add_argument("prompt", nargs="*", help="prompts (default: two examples)")
    generate.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass")
    generate.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    generate.add_argument("--sampling-seed", type=int, default=None,
                          help="the requests' sampling seed (default: the engine's --seed)")
    generate.set_defaults(func=cmd_generate)
    add_api_keys_command(commands)
    for name, module in SERVICES.items():
        commands.add_parser(name, help=f"run {'gateway, scheduler and one worker' if name == 'serve' else 'the ' + name} "
                                      f"(see pagedserve {name} --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVICES:
        import importlib

        return importlib.import_module(SERVICES[argv[0]]).main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
