"""Session-wide fixtures: tiny random models of each supported architecture, made once per run."""

from __future__ import annotations

import os
from pathlib import Path

# Triton decides interpreted or compiled when a kernel module is first imported: decided here, once for the
# session, before any test module imports one (the Triton test modules ask for the interpreter too, but a module
# collected or run before theirs could import the kernels compiled, and the interpreted tests then fail).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


# The files that take longest (a minute or more each on 2 cores), started first: with the tests spread over
# two processes a file at a time (-n 2 --dist loadfile), one of these last would leave the other process idle.
# Each as <folder>/<file> below tests/.
SLOW_FIRST = ("worker/test_triton_compile.py", "e2e/test_benchmarks.py", "gateway/test_backend_failures.py",
              "e2e/test_gpu_kernels_script.py", "e2e/test_launcher.py", "worker/test_tensor_parallel.py")


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        name = "/".join(item.path.parts[-2:])
        return SLOW_FIRST.index(name) if name in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: each file's own order is kept


def pytest_sessionstart(session):
    """Build the C++ CPU kernels before any test runs, so no worker process a test starts builds them (or
    waits for them) while the test waits on its health check. Under pytest-xdist the controller gets here
    before it starts the test processes, which then find the build published; a concurrent run from
    another checkout with the same sources builds it once between them (cpu_kernels.py)."""
    from services.worker.attention.cpu_kernels import build_root, load_cpu_kernels

    load_cpu_kernels(build_root(), wait_s=KERNEL_BUILD_WAIT_S)  # without a compiler: the torch backend


KERNEL_BUILD_WAIT_S = 900.0  # longer than any build takes, even beside another run on the same cores


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``make(model_type, **overrides) -> Path``; the same arguments give the same directory."""
    from services.worker.model_factory import create_model_dir

    made: dict[str, Path] = {}

    def make(model_type: str = "llama", **overrides) -> Path:
        kwargs = {**TINY, **overrides}
        key = f"{model_type}-{sorted(kwargs.items())!r}"
        if key not in made:
            path = tmp_path_factory.mktemp(f"{model_type}-model")
            made[key] = create_model_dir(path, model_type=model_type, **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(tiny_model_factory):
    # Grouped-query attention (4 heads share 2 KV heads) and Llama-3 rope scaling.
    return tiny_model_factory("llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})


@pytest.fixture(scope="session")
def mistral_dir(tiny_model_factory):
    # Multi-query attention, full (mistral_window_dir has the window).
    return tiny_model_factory("mistral", num_key_value_heads=1, sliding_window=None)


@pytest.fixture(scope="session")
def qwen2_dir(tiny_model_factory):
    return tiny_model_factory("qwen2")  # q/k/v biases


@pytest.fixture(scope="session")
def qwen3_dir(tiny_model_factory):
    # Per-head q/k norms; head_dim (32) deliberately differs from hidden / heads (16).
    return tiny_model_factory("qwen3", head_dim=32)


@pytest.fixture(scope="session")
def mistral_window_dir(tiny_model_factory):
    # Every layer attends within 12 keys: most of a test's context lies outside the window.
    return tiny_model_factory("mistral", sliding_window=12)


@pytest.fixture(scope="session")
def qwen2_window_dir(tiny_model_factory):
    # Layer 0 full, layer 1 within a 20-key window (max_window_layers): both kinds in every step.
    return tiny_model_factory("qwen2", use_sliding_window=True, sliding_window=20, max_window_layers=1)


@pytest.fixture(scope="session")
def gemma_dir(tiny_model_factory):
    # GeGLU, (1 + weight) norms, scaled embeddings, tied head (as Gemma's).
    return tiny_model_factory("gemma", head_dim=16, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def gemma2_dir(tiny_model_factory):
    # Sandwich norms; layer 0 within a 10-key window, layer 1 full; an attention scale of 12 ** -0.5, not
    # head_dim's; attention scores capped at 5 and logits at 10 (small caps: they bend these models' values).
    return tiny_model_factory("gemma2", head_dim=16, tie_word_embeddings=True, query_pre_attn_scalar=12,
                              sliding_window=10, attn_logit_softcapping=5.0, final_logit_softcapping=10.0)


@pytest.fixture(scope="session")
def gemma3_dir(tiny_model_factory):
    # q/k norms; layer 0 slides (10 keys, its own RoPE base), layer 1 is full with linearly scaled RoPE.
    return tiny_model_factory("gemma3_text", head_dim=32, tie_word_embeddings=True, query_pre_attn_scalar=24,
                              sliding_window=10, sliding_window_pattern=2,
                              rope_scaling={"rope_type": "linear", "factor": 2.0})


@pytest.fixture(scope="session")
def gemma3_multimodal_dir(tiny_model_factory):
    # Gemma3ForConditionalGeneration (Gemma 3 from 4B up): a vision tower beside the text model, served for text.
    return tiny_model_factory("gemma3", head_dim=32, query_pre_attn_scalar=24, sliding_window=10,
                              sliding_window_pattern=2)


@pytest.fixture(scope="session")
def llava_dir(tiny_model_factory):
    # LlavaForConditionalGeneration (LLaVA-1.5) over the tiny Llama: a 2-layer CLIP tower of 28-pixel images, 4
    # patches of 14 (4 placeholder tokens an image), features from its second-to-last layer, the two-layer projector.
    return tiny_model_factory("llava")


@pytest.fixture(scope="session")
def llava_next_dir(tiny_model_factory):
    # LlavaNextForConditionalGeneration (LLaVA-NeXT): the same tower, each image as an overview and up to 2 by 2
    # tiles (the resolution its size fits best), packed with a newline row after each row of patches.
    return tiny_model_factory("llava_next", max_position_embeddings=1024)


@pytest.fixture(scope="session")
def qwen2_vl_dir(tiny_model_factory):
    # Qwen2VLForConditionalGeneration: a 2-layer tower of 14-pixel patches merged 2 by 2, images of 2 by 2 to 4 by 4
    # placeholder tokens, and M-RoPE (rotary pairs 2, 3, 3 for time, height, width) over the tiny Qwen 2.
    return tiny_model_factory("qwen2_vl")


@pytest.fixture(scope="session")
def qwen2_5_vl_dir(tiny_model_factory):
    # Qwen2_5_VLForConditionalGeneration: the same, its tower's first layer attending within windows of 2 by 2 tokens.
    return tiny_model_factory("qwen2_5_vl")


@pytest.fixture(scope="session")
def granite_dir(tiny_model_factory):
    # Granite 3's four multipliers (its 8B's embedding and residual ones, an attention scale of its own, logits
    # divided by 4), with biases on attention and the MLP.
    return tiny_model_factory("granite", embedding_multiplier=12.0, residual_multiplier=0.22,
                              attention_multiplier=0.15, logits_scaling=4.0, attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="session")
def olmo2_dir(tiny_model_factory):
    # Norms after attention and the MLP only (scaled in float32), q/k norms over the whole projection; one KV
    # head, so two ranks hold it both (their sums of squares then count it twice, and so do their counts).
    return tiny_model_factory("olmo2", num_key_value_heads=1)


@pytest.fixture(scope="session")
def smollm3_dir(tiny_model_factory):
    # Every other layer without RoPE (NoPE), and those within a 10-key window.
    return tiny_model_factory("smollm3", no_rope_layer_interval=2, use_sliding_window=True, sliding_window=10)


@pytest.fixture(scope="session")
def phi3_dir(tiny_model_factory):
    # Fused qkv_proj and gate_up_proj in the checkpoint; every layer within 12 keys; half of each head
    # rotates (Phi-4-mini's partial rotary); tied head.
    return tiny_model_factory("phi3", head_dim=16, sliding_window=12, partial_rotary_factor=0.5,
                              tie_word_embeddings=True)


@pytest.fixture(scope="session")
def phi3_longrope_dir(tiny_model_factory):
    # LongRoPE (Phi-3-mini-128k's): short factors within 64 positions, long ones past; fresh factors each run.
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    short, long = 1 + torch.rand(8, generator=generator), 1 + 4 * torch.rand(8, generator=generator)
    return tiny_model_factory("phi3", head_dim=16, original_max_position_embeddings=64, rope_scaling={
        "rope_type": "longrope", "short_factor": short.tolist(), "long_factor": long.tolist()})


@pytest.fixture(scope="session")
def yarn_dir(tiny_model_factory):
    # Qwen2.5's long-context setting: YaRN by 4 over a pretraining length of 64 (the ramp spans dimensions).
    return tiny_model_factory("qwen2", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64})


@pytest.fixture(scope="session")
def tied_dir(tiny_model_factory):
    return tiny_model_factory("llama", tie_word_embeddings=True, rope_scaling={"rope_type": "linear",
                                                                                "factor": 2.0})


@pytest.fixture(scope="session")
def mixtral_dir(tiny_model_factory):
    # Every layer sparse: 4 experts, 2 per token, their weights renormalised and kept in float32.
    return tiny_model_factory("mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None)


@pytest.fixture(scope="session")
def qwen2_moe_dir(tiny_model_factory):
    # A shared expert beside the routed ones; the top-k weights are not renormalised.
    return tiny_model_factory("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48)


@pytest.fixture(scope="session")
def qwen3_moe_dir(tiny_model_factory):
    # 8 experts of 32 columns, 2 per token, renormalised; layer 1 dense (mlp_only_layers); q/k norms.
    return tiny_model_factory("qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              norm_topk_prob=True, mlp_only_layers=[1], head_dim=32)
