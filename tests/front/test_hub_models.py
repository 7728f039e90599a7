"""Models named by Hub id (org/name): resolved from a Hugging Face cache with no network, at a revision,
served by `pagedserve serve` and the offline LLM with the model's generation defaults; every way a Hub id
fails is one line and exit code 1."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from tests import patient_http as httpx
import pytest
import torch
from safetensors.torch import load_file

from pagedserve import LLM, SamplingParams
from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_api_pb2_grpc as api_grpc
from tests.hub_cache import add_to_hub_cache, refusing_hub
from tests.services_harness import REPO, START_LIMIT_S, free_port, http_get

REPO_ID = "org/tiny"
# Revision v2's generation_config.json: greedy, at most 5 new tokens; its weights are pickled (.bin).
V2_DEFAULTS = {"temperature": 0.0, "max_new_tokens": 5, "top_p": 0.9}
PROMPTS = ["Hello, my name is", "The capital of France is"]


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, llama_dir) -> Path:
    """A Hugging Face cache holding org/tiny: main is llama_dir as it is; v2 the same weights as
    pytorch_model.bin with generation defaults."""
    v2 = tmp_path_factory.mktemp("v2")
    for file in llama_dir.iterdir():
        if file.suffix != ".safetensors" and file.name != "model.safetensors.index.json":
            shutil.copy(file, v2 / file.name)
    weights = {}
    for shard in llama_dir.glob("*.safetensors"):
        weights.update(load_file(shard))
    torch.save(weights, v2 / "pytorch_model.bin")
    config = json.loads((llama_dir / "generation_config.json").read_text())
    (v2 / "generation_config.json").write_text(json.dumps({**config, **V2_DEFAULTS}))
    cache = tmp_path_factory.mktemp("hf_home") / "hub"
    add_to_hub_cache(cache, REPO_ID, {"main": llama_dir, "v2": v2})
    return cache


@pytest.fixture
def offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def _greedy(llm: LLM, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_the_offline_llm_loads_a_revision_from_the_cache_with_its_defaults(hub_cache, llama_dir, offline):
    local = LLM(str(llama_dir), kv_cache_memory_bytes=8 << 20)
    try:
        expected = _greedy(local, 5)
    finally:
        local.close()
    llm = LLM(REPO_ID, revision="v2", download_dir=str(hub_cache), kv_cache_memory_bytes=8 << 20)
    try:
        assert "snapshots" in llm.config.model  # resolved once, before the worker started
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.0, 0.9, 5)
        # no params: the model's (greedy, 5 tokens); the same weights, read from pytorch_model.bin
        outputs = llm.generate([{"prompt": p} for p in PROMPTS], use_tqdm=False)
        got = [out.outputs[0].token_ids for out in outputs]
        assert all(len(ids) <= 5 for ids in got)
        assert [e[:len(g)] for e, g in zip(expected, got)] == got
        assert _greedy(llm, 5) == expected  # weights equal: .bin as .safetensors
    finally:
        llm.close()


def test_generation_config_vllm_and_override(hub_cache, offline):
    llm = LLM(REPO_ID, revision="v2", download_dir=str(hub_cache), kv_cache_memory_bytes=8 << 20,
              generation_config="vllm", override_generation_config={"max_new_tokens": 3, "top_k": 7})
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (1.0, 1.0, 7, 3)
    finally:
        llm.close()


def _serve(hub_cache: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, int, int]:
    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve", "serve", "--model", REPO_ID, "--port", str(port),
                             "--grpc-port", str(grpc_port), "--kv-cache-memory-bytes", str(8 << 20), *extra],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + START_LIMIT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        try:
            if http_get(f"http://127.0.0.1:{port}/health", 2)[0] == 200:
                return proc, port, grpc_port
        except OSError:
            pass
        time.sleep(0.25)
    os.killpg(proc.pid, signal.SIGKILL)
    raise TimeoutError((tmp_path / "serve.log").read_text()[-3000:])


def test_serve_takes_a_hub_id_offline_with_its_generation_defaults(hub_cache, llama_dir, tmp_path):
    local = LLM(str(llama_dir), kv_cache_memory_bytes=8 << 20)
    try:
        tokenizer = local.tokenizer
        expected = _greedy(local, 4)
    finally:
        local.close()
    proc, port, grpc_port = _serve(hub_cache, tmp_path, "--revision", "v2",
                                   "--override-generation-config", '{"max_new_tokens": 4}')
    try:
        base = f"http://127.0.0.1:{port}/v1"
        assert [m["id"] for m in httpx.get(f"{base}/models").json()["data"]] == [REPO_ID]
        for prompt, ids in zip(PROMPTS, expected):
            # neither temperature nor max_tokens given: greedy (the file), 4 tokens (the override)
            reply = httpx.post(f"{base}/completions", json={"model": REPO_ID, "prompt": prompt, "ignore_eos": True},
                               timeout=60).json()
            assert reply["usage"]["completion_tokens"] == 4, reply
            assert reply["choices"][0]["text"] == tokenizer.decode(ids)
            chat = httpx.post(f"{base}/chat/completions", json={
                "model": REPO_ID, "messages": [{"role": "user", "content": prompt}], "ignore_eos": True,
                "max_completion_tokens": 100}, timeout=60).json()
            assert chat["usage"]["completion_tokens"] == 4, chat  # capped
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stream = api_grpc.GenerationStub(channel).Generate(
                api.GenerateRequest(text=PROMPTS[0], params=api.SamplingParameters(ignore_eos=True)), timeout=60)
            tokens = [t for reply in stream for t in reply.token_ids]
        assert tokens == expected[0]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


REFUSALS = {
    "not cached, offline": ({"HF_HUB_OFFLINE": "1"}, "org/absent", None, "HF_HUB_OFFLINE=1 forbids downloading"),
    "no such revision in the cache, offline": ({"HF_HUB_OFFLINE": "1"}, REPO_ID, "v3", "at revision 'v3'"),
    "gated": ((401, "GatedRepo"), "org/gated", None, "gated: accept its terms"),
    "no such repository": ((404, "RepoNotFound"), "org/absent", None, "no such repository"),
    "no such revision": ((404, "RevisionNotFound"), "org/absent", "v9", "no such revision"),
    "the Hub failing": ((503, "Overloaded"), "org/absent", None, "the Hub answered HTTP 503"),
    "not a Hub id either": ({}, "./no/such/dir", None, "does not exist or is not a directory"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_hub_id_that_cannot_be_served_is_one_line_and_exit_1(case, hub_cache):
    how, model, revision, says = REFUSALS[case]
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "0"}
    flags = ["--model", model, *(["--revision", revision] if revision else [])]
    with refusing_hub(*how) if isinstance(how, tuple) else _nothing() as endpoint:
        env.update({"HF_ENDPOINT": endpoint} if endpoint else how)
        done = subprocess.run([sys.executable, "-m", "pagedserve", "serve", *flags, "--port", str(free_port())],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert len(errors) == 1 and says in errors[0] and model in errors[0], done.stderr


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
