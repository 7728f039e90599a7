"""The gateway stack most files here share: started once per test process, on first use, and stopped at the
end of the session.

One file held these tests and a module-scoped stack; split by concern, a stack per file would start one per
file (about 6 s each on 2 cores, and 1 s to stop). Session-scoped, a run starts it once, and the suite's two
processes (-n 2 --dist loadfile) at most once each. A file that defines a `stack` of its own uses that one."""

from __future__ import annotations

import json

import openai
import pytest

from pagedserve import LLM
from tests.gateway.shared_stack import WORKER_ARGS
from tests.lora_adapters import make_adapter
from tests.services_harness import Stack


@pytest.fixture(scope="session")
def sql_adapter(llama_dir, tmp_path_factory):
    return make_adapter(llama_dir, tmp_path_factory.mktemp("adapters") / "sql", rank=8, seed=4)


@pytest.fixture(scope="session")
def stack(llama_dir, sql_adapter, tmp_path_factory):
    # LoRA on: requests without an adapter run as before (the adapters' matmuls are skipped).
    stack = Stack(llama_dir, tmp_path_factory.mktemp("gateway-logs"),
                  worker_args=WORKER_ARGS + ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"),
                  gateway_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                "--allow-runtime-lora-updating", "--trust-request-chat-template",
                                "--served-model-name", llama_dir.name, "llama-alias",
                                "--lora-modules", f"sql={sql_adapter}",  # several after one flag, as vLLM's
                                json.dumps({"name": "broken", "path": "/nowhere", "base_model_name": "hub/llama"}))
                  ).start()
    try:
        yield stack
    finally:
        codes = stack.stop()
    assert all(code is not None for code in codes.values()), codes
    assert codes["gateway"] == 0, f"the gateway did not shut down cleanly: {codes}\n{stack.log_tail('gateway')}"
    for name in codes:  # frozen start-up objects left to the exit: nanobind (Triton) reports them as leaks
        assert "nanobind: leaked" not in (stack.log_dir / f"{name}.log").read_text(errors="replace"), \
            stack.log_tail(name)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(str(llama_dir), block_size=16)
