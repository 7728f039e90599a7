"""What `pagedserve serve` and `pagedserve generate` check before they start anything: a mistake
found here costs a second and one line, where a child would find it after building its kernels and
loading a model (tens of seconds) and say it in a traceback."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from services.gateway.lora_modules import parse_lora_modules
from services.worker.model_impl import chosen_impl, model_config_for, refuse_on_transformers_path
from shared.gguf_view import GGUF_FILE
from shared.hub import local_model_and_tokenizer, names_a_hub_repo
from shared.lora import read_adapter_config
from shared.pooling import resolve_runner


def resolve_hub_ids(args) -> str | None:
    """Replace --model and --tokenizer given as Hub ids by their local snapshots (downloaded where missing),
    so that every child reads the same files; what went wrong, as one line (None: nothing)."""
    if args.model and names_a_hub_repo(args.model):
        print(f"pagedserve: resolving {args.model} on the Hugging Face Hub (or in its cache)", file=sys.stderr,
              flush=True)
    try:
        args.model, args.tokenizer = local_model_and_tokenizer(
            args.model, args.tokenizer, revision=args.revision, tokenizer_revision=args.tokenizer_revision,
            download_dir=args.download_dir)
    except (FileNotFoundError, ValueError) as exc:
        return str(exc)
    return None


def model_error(args) -> str | None:
    """What is wrong with the model directory (None: nothing found; no --model: the built-in one, made
    by the worker). Its config.json is read as the worker reads it, so an architecture the worker cannot
    run (natively, or through transformers as --model-impl allows) is refused here, naming the file."""
    if not args.model:
        return None
    model_dir = Path(args.model)
    try:
        if (model_dir / GGUF_FILE).is_file():
            # Imported where needed, here and below: they import torch (seconds), which no other mistake waits for.
            from services.worker.quantization.gguf_checkpoint import gguf_names

            gguf_names(model_dir / GGUF_FILE)  # an architecture or tensor type not built: refused by name
        impl = chosen_impl(args.model_impl, model_dir)
        model_config_for(impl, model_dir, args.trust_remote_code)
        if impl == "transformers":
            refuse_on_transformers_path(args.tensor_parallel_size, resolve_runner(args.runner, model_dir) == "pooling",
                                       args.quantization)
        else:
            from services.worker.quantization.method import read_quantization

            read_quantization(model_dir, args.quantization)  # a method or scheme not built: likewise
    except (FileNotFoundError, ValueError) as exc:
        return str(exc)
    return None


def port_taken_error(host: str, port: int, what: str) -> str | None:
    """Whether something on this machine already listens where a child is to listen (None: free).
    Bound as the servers bind (SO_REUSEADDR, so a socket still in TIME_WAIT counts as free), then let go."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        return f"--host {host!r} is not an address of this machine: {exc.strerror}"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return f"{what} {port} on {host} cannot be used: {exc.strerror.lower()}"
    return None


def lora_modules_error(entries: list[str], max_lora_rank: int) -> str | None:
    """What is wrong with the adapters (every process here sees their directories: read them now)."""
    try:
        for module in parse_lora_modules(entries):
            lora = module.lora
            rank = read_adapter_config(lora.path).rank
            if rank > max_lora_rank:
                return f"LoRA adapter {lora.name!r} has rank {rank}, above --max-lora-rank {max_lora_rank}"
    except ValueError as exc:
        return str(exc)
    return None
