"""The model's generation_config.json as the defaults of requests that leave a field unset (vLLM's
--generation-config auto), over HTTP's request bodies and gRPC's messages."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from shared.config import EngineConfig
from shared.generation_defaults import GenerationDefaults, read_generation_defaults
from shared.proto import pagedserve_api_pb2 as api
from shared.sampling_params import SamplingParams
from tests.services_harness import REPO

FILE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
        "max_new_tokens": 64, "do_sample": True, "eos_token_id": [1, 2], "transformers_version": "5.0"}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(FILE))
    return tmp_path


def test_auto_reads_the_sampling_fields_and_the_cap(model_dir):
    defaults = read_generation_defaults("auto", model_dir)
    assert dict(defaults.sampling) == {k: FILE[k] for k in ("temperature", "top_p", "top_k", "min_p",
                                                             "repetition_penalty")}
    assert defaults.max_tokens == 64 and defaults.source.endswith("generation_config.json")


def test_vllm_ignores_the_file_a_directory_replaces_it_and_overrides_win(model_dir, tmp_path_factory):
    assert read_generation_defaults("vllm", model_dir).as_dict() == {}
    other = tmp_path_factory.mktemp("other")
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert read_generation_defaults(str(other), model_dir).as_dict() == {"temperature": 0.3}
    assert read_generation_defaults("auto", model_dir, '{"temperature": 0.0, "max_new_tokens": 8}').as_dict() == {
        **{k: FILE[k] for k in ("top_p", "top_k", "min_p", "repetition_penalty")}, "temperature": 0.0,
        "max_tokens": 8}
    assert read_generation_defaults("auto", None).as_dict() == {}  # no folder, no file: nothing


@pytest.mark.parametrize("mode, override, says", [
    ("/no/such/folder", None, "neither 'auto', 'vllm' nor a directory"),
    ("auto", '{"temperature": -1}', "temperature"),
    ("auto", '{"beams": 2}', "fields no request takes: beams"),
    ("auto", "[1]", "must be a JSON object"),
    ("auto", "{", "not JSON"),
    ("auto", '{"max_new_tokens": 0}', "max_new_tokens must be an integer >= 1"),
])
def test_bad_generation_configs_are_refused_by_name(model_dir, mode, override, says):
    with pytest.raises(ValueError, match=says):
        read_generation_defaults(mode, model_dir, override)


def test_a_request_keeps_what_it_sets_and_takes_the_rest(model_dir):
    defaults = read_generation_defaults("auto", model_dir)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=1.0, top_k=-1,
                                 max_completion_tokens=500)
    params = chat.checked_params(defaults)
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty) == \
        (1.0, None, 0.95, 0.05, 1.1)
    assert params.max_tokens == 64  # capped by max_new_tokens
    unset = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=None)  # null: unset
    assert (unset.checked_params(defaults).temperature, unset.checked_params(defaults).max_tokens) == (0.6, 64)
    completion = CompletionRequest(prompt="hi", max_tokens=10)
    assert completion.checked_params(defaults).max_tokens == 10  # below the cap: as asked
    assert CompletionRequest(prompt="hi").checked_params().temperature == 1.0  # without defaults: the engine's


def test_a_grpc_message_keeps_what_it_sets_and_takes_the_rest():
    defaults = GenerationDefaults({"temperature": 0.5, "repetition_penalty": 1.2}, 32)
    params = SamplingParams.from_proto(api.SamplingParameters(temperature=0.0, max_tokens=100), defaults=defaults)
    assert (params.temperature, params.repetition_penalty, params.max_tokens) == (0.0, 1.2, 32)
    assert SamplingParams.from_proto(api.SamplingParameters(), defaults=defaults).max_tokens == 32
    assert SamplingParams.from_proto(api.SamplingParameters()).max_tokens is None  # no cap: up to the context


def test_the_override_is_checked_as_flags_are_read():
    assert EngineConfig(override_generation_config={"top_k": 3}).override_generation_config == '{"top_k": 3}'
    with pytest.raises(ValueError, match="fields no request takes"):
        EngineConfig(override_generation_config='{"nope": 1}')
    done = subprocess.run([sys.executable, "-m", "pagedserve", "serve", "--override-generation-config", "{oops"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "override_generation_config is not JSON" in done.stderr
