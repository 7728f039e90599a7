"""The `pagedserve` command."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from shared.config import ATTENTION_BACKENDS
from shared.pooling import RUNNERS
from shared.speculative_config import SpeculativeConfig


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


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, with vLLM's names where they mean the same thing."""
    parser.add_argument("--model", default=None, help="Hugging Face model directory (default: the built-in model, "
                                                      "made on first use; its weights are random)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights' and activations' type; auto: the checkpoint's")
    parser.add_argument("--runner", default="auto", choices=list(RUNNERS),
                        help="generate tokens, or pool prompts into embeddings (/v1/embeddings); auto: pooling for "
                             "a sentence-transformers directory or a bare *Model architecture")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available, else CPU), cpu, cuda or cuda:N")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of requests that bring none")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest context, prompt and output together (default: the model's "
                             "max_position_embeddings)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (a power of two)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most sequences one step runs")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="most tokens one step computes (default: 4096; without chunked prefill at least "
                             "--max-model-len)")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="split long prompts over several steps, beside running decodes")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of the GPU's memory the worker may use, KV cache included (CUDA)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="bytes for the KV cache (default: on CPU 4 GiB; on CUDA what "
                             "--gpu-memory-utilization leaves)")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="exact KV-cache block count, for tests and experiments (default: from the memory budget)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV of full blocks whose prefix was computed before")
    parser.add_argument("--swap-space", type=float, default=4.0, help="GiB of host memory for swapped-out KV")
    parser.add_argument("--preemption-mode", choices=["swap", "recompute"], default=None,
                        help="how preempted sequences give back their blocks (default: chosen per victim)")
    parser.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS), default="auto",
                        help="auto: Triton on CUDA, the C++ kernels on CPU (torch where they cannot build)")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                        help="never replay decode steps from CUDA graphs (they are captured at a CUDA worker's start)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="workers that hold the model between them (its heads and MLP columns split)")
    parser.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=False,
                        help="serve LoRA adapters: requests may name one (the gateway's --lora-modules)")
    parser.add_argument("--max-loras", type=int, default=1, help="distinct LoRA adapters one step may run")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="the largest LoRA rank taken")
    parser.add_argument("--speculative-config", type=speculative_config_json, default=None,
                        help='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                             '"prompt_lookup_max": 4, "prompt_lookup_min": 2} (default: off)')


def speculative_config_json(raw: str) -> str | None:
    """--speculative-config checked when the flags are read (a clear usage error), kept as JSON; empty: off
    (compose passes an unset variable as the empty string)."""
    if not raw.strip():
        return None
    try:
        return SpeculativeConfig.parse(raw).to_json()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


ENGINE_KEYS = ("model", "tokenizer", "runner", "dtype", "device", "seed", "max_model_len", "block_size", "max_num_seqs",
               "max_num_batched_tokens", "enable_chunked_prefill", "gpu_memory_utilization",
               "kv_cache_memory_bytes", "num_gpu_blocks_override", "enable_prefix_caching", "swap_space",
               "preemption_mode", "attention_backend", "enforce_eager", "speculative_config", "tensor_parallel_size",
               "enable_lora", "max_loras", "max_lora_rank")


def engine_options(args: argparse.Namespace) -> dict:
    return {key: getattr(args, key) for key in ENGINE_KEYS}


def progress(message: str) -> None:
    """A phase of a long command, on stderr (stdout carries its results)."""
    print(f"pagedserve: {message}", file=sys.stderr, flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedserve.preflight import model_error

    if (error := model_error(args.model)) is not None:
        raise ValueError(error)
    progress("importing the engine")
    from pagedserve import LLM, SamplingParams

    options = engine_options(args)
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
    from services.gateway.api_keys import DEFAULT_PREFIX

    keys = commands.add_parser("api-keys", help="make, list and revoke API keys in the Redis key store")
    store = argparse.ArgumentParser(add_help=False)  # --store, after the action as before it
    store.add_argument("--store", default=os.environ.get("PAGEDSERVE_API_KEY_STORE", "redis://127.0.0.1:6379/0"),
                       help="Redis URL of the key store (default: $PAGEDSERVE_API_KEY_STORE, else the local Redis)")
    store.add_argument("--prefix", default=os.environ.get("PAGEDSERVE_API_KEY_STORE_PREFIX", DEFAULT_PREFIX),
                       help="the gateways' --api-key-store-prefix")
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


def apply_env_defaults(parser: argparse.ArgumentParser, prefix: str = "PAGEDSERVE_") -> None:
    """Every flag may also come from the environment: --max-num-seqs from PAGEDSERVE_MAX_NUM_SEQS.

    That is how compose.yaml configures the services. A flag on the command line still wins.
    """
    for action in parser._actions:  # argparse has no public way to list the options
        if not action.option_strings or action.dest == "help":
            continue
        variable = prefix + action.dest.upper()
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
    add_engine_args(generate)
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
