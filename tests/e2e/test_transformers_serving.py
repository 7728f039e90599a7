"""An architecture with no native model served by the services (worker, scheduler, gateway) through
transformers' modelling code: a streamed and a whole completion equal transformers' greedy output."""

from __future__ import annotations

import json

from tests import patient_http as httpx

from tests.generic_models import make_generic_model
from tests.oracle import assert_greedy_equal, hf_greedy
from tests.services_harness import Stack

PROMPT = [11, 57, 203, 9, 311, 48, 77, 130, 5, 6, 7]
MAX_TOKENS = 12


def test_the_services_serve_a_gpt2_through_transformers(tmp_path_factory):
    model_dir = make_generic_model(tmp_path_factory.mktemp("models") / "tiny-gpt2", "gpt2")
    ref, ref_logprobs = hf_greedy(model_dir, PROMPT, MAX_TOKENS)
    body = {"model": "tiny-gpt2", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with Stack(model_dir, tmp_path_factory.mktemp("logs"), worker_args=("--kv-cache-memory-bytes", str(4 << 20))) as stack:
        whole = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=120).json()
        with httpx.stream("POST", f"{stack.base_url}/v1/completions", json={**body, "stream": True},
                          timeout=120) as reply:
            chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    assert_greedy_equal(whole["choices"][0]["token_ids"], ref, ref_logprobs, "whole")
    streamed = [t for chunk in chunks for t in chunk["choices"][0].get("token_ids") or []]
    assert streamed == whole["choices"][0]["token_ids"]


def test_serve_refuses_what_transformers_cannot_run_in_one_line(tmp_path):
    import subprocess
    import sys

    from transformers import AutoConfig

    from tests.services_harness import REPO, free_port

    AutoConfig.for_model("t5").save_pretrained(tmp_path)
    done = subprocess.run([sys.executable, "-m", "pagedserve", "serve", "--model", str(tmp_path), "--port",
                           str(free_port())], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "encoder-decoder" in done.stderr.splitlines()[-1], done.stderr
