"""LoRA adapters: greedy tokens with an adapter equal transformers' on the weights with it merged in,
whatever shares the batch; slots, the per-step adapter limit, the prefix cache and bad adapters."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM, LoRARequest, SamplingParams
from shared.config import EngineConfig
from shared.lora import read_adapter_config
from tests.lora_adapters import ATTENTION, make_adapter, merged_model
from tests.oracle import assert_greedy_equal, hf_greedy
from shared.request import EngineRequest

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def prompts(seed: int, lengths=(1, 9, 40, 70)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    """Two adapters of different ranks and modules, and the merged model of each."""
    root = tmp_path_factory.mktemp("lora")
    every = make_adapter(llama_dir, root / "every", rank=8, alpha=16, seed=1)
    attention = make_adapter(llama_dir, root / "attention", rank=4, alpha=4, modules=ATTENTION, seed=2,
                             config_extra={"use_rslora": True})
    return {"every": (LoRARequest("every", str(every)), merged_model(llama_dir, every, root / "every-merged")),
            "attention": (LoRARequest("attention", str(attention)),
                          merged_model(llama_dir, attention, root / "attention-merged"))}


def check(outputs, prompt_list, model_dir, what):
    for prompt, out in zip(prompt_list, outputs):
        ref, ref_logprobs = hf_greedy(model_dir, prompt, MAX_TOKENS)
        assert_greedy_equal(out.outputs[0].token_ids, ref, ref_logprobs, f"{what}, prompt of {len(prompt)}")


def test_adapters_and_the_base_model_in_one_batch_equal_transformers_merged(llama_dir, adapters):
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8, block_size=8,
              max_num_batched_tokens=48)
    batch = prompts(seed=5)
    every, every_merged = adapters["every"]
    attention, attention_merged = adapters["attention"]
    # Each prompt three times in one call: with either adapter and without, chunked prefills beside decodes.
    loras = [every] * 4 + [None] * 4 + [attention] * 4
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch * 3], GREEDY, use_tqdm=False, lora_request=loras)
    check(outputs[:4], batch, every_merged, "adapter on every projection")
    check(outputs[4:8], batch, llama_dir, "base model")
    check(outputs[8:], batch, attention_merged, "rsLoRA adapter on attention")
    assert outputs[0].outputs[0].token_ids != outputs[4].outputs[0].token_ids, "the adapter changed nothing"
    assert llm.stats()["kv_blocks_used"] == 0


def test_an_adapter_on_phi3_s_fused_projections_equals_transformers_merged(phi3_dir, tmp_path):
    # Phi-3's PEFT adapters target qkv_proj and gate_up_proj, whose B spans the fused rows: cut per part here.
    adapter = make_adapter(phi3_dir, tmp_path / "fused", rank=8, modules=("qkv_proj", "o_proj", "gate_up_proj",
                                                                          "down_proj"), seed=4)
    merged = merged_model(phi3_dir, adapter, tmp_path / "merged")
    llm = LLM(str(phi3_dir), enable_lora=True, max_lora_rank=8, block_size=8, max_num_batched_tokens=48)
    batch = prompts(seed=6)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch * 2], GREEDY, use_tqdm=False,
                           lora_request=[LoRARequest("fused", str(adapter))] * 4 + [None] * 4)
    check(outputs[:4], batch, merged, "adapter on fused projections")
    check(outputs[4:], batch, phi3_dir, "base model")
    assert outputs[2].outputs[0].token_ids != outputs[6].outputs[0].token_ids, "the adapter changed nothing"


def test_an_adapter_trained_on_a_multimodal_checkpoint_applies_to_its_language_model(gemma3_multimodal_dir, tmp_path):
    # PEFT names a Gemma 3 (4B and up) fine-tune's modules inside the wrapper: language_model.model.layers...
    adapter = make_adapter(gemma3_multimodal_dir, tmp_path / "mm", rank=8, modules=ATTENTION, seed=7)
    assert any(".language_model.model.layers." in name for name in load_file(adapter / "adapter_model.safetensors"))
    merged = merged_model(gemma3_multimodal_dir, adapter, tmp_path / "merged")
    llm = LLM(str(gemma3_multimodal_dir), enable_lora=True, max_lora_rank=8, block_size=8, max_num_batched_tokens=48)
    batch = prompts(seed=8)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False,
                           lora_request=LoRARequest("mm", str(adapter)))
    check(outputs, batch, merged, "adapter on a multimodal checkpoint's language model")


def test_one_slot_serves_adapters_in_turn_and_reloads_an_evicted_one(llama_dir, adapters):
    # max_loras=1: the scheduler runs one adapter at a time (the worker refuses a step with two).
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=1, max_lora_rank=8)
    batch = prompts(seed=6, lengths=(5, 30))
    every, every_merged = adapters["every"]
    attention, attention_merged = adapters["attention"]
    order = [every, attention, None, every]
    outputs = llm.generate([{"prompt_token_ids": p} for lora in order for p in batch], GREEDY, use_tqdm=False,
                           lora_request=[lora for lora in order for _ in batch])
    check(outputs[0:2], batch, every_merged, "first adapter")
    check(outputs[2:4], batch, attention_merged, "second adapter")
    check(outputs[4:6], batch, llama_dir, "base model")
    check(outputs[6:8], batch, every_merged, "first adapter again")
    again = llm.generate({"prompt_token_ids": batch[0]}, GREEDY, use_tqdm=False, lora_request=attention)
    check(again, batch[:1], attention_merged, "second adapter, read again after its eviction")


def test_prefix_cache_blocks_are_shared_only_under_the_same_adapter(llama_dir, adapters):
    llm = LLM(str(llama_dir), enable_lora=True, max_lora_rank=8, block_size=8)
    prompt = {"prompt_token_ids": prompts(seed=7, lengths=(33,))[0]}
    every, attention = adapters["every"][0], adapters["attention"][0]

    def cached(lora):
        return llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(None) == 0
    assert cached(every) == 0, "an adapter's request read the base model's KV"
    assert cached(attention) == 0, "one adapter's request read another's KV"
    assert cached(every) == 32 and cached(None) == 32


def test_bad_adapters_fail_their_request_and_the_engine_serves_on(llama_dir, adapters, tmp_path):
    llm = LLM(str(llama_dir), enable_lora=True, max_lora_rank=4)
    prompt = {"prompt_token_ids": prompts(seed=8, lengths=(12,))[0]}
    make_adapter(llama_dir, tmp_path / "wide", rank=8)
    # A pattern in the config: only the weights' names show the output head.
    make_adapter(llama_dir, tmp_path / "head", rank=4, modules=("lm_head",), config_extra={"target_modules": "lm_head"})
    other = make_adapter(llama_dir, tmp_path / "other", rank=4, modules=ATTENTION)
    tensors = load_file(other / "adapter_model.safetensors")
    name = next(n for n in tensors if n.endswith("q_proj.lora_B.weight"))
    tensors[name] = tensors[name][:8]  # a model with fewer query heads
    save_file(tensors, other / "adapter_model.safetensors")
    half = make_adapter(llama_dir, tmp_path / "half", rank=4, modules=("v_proj",))
    save_file({n: t for n, t in load_file(half / "adapter_model.safetensors").items() if "lora_A" in n},
              half / "adapter_model.safetensors")
    poisoned = make_adapter(llama_dir, tmp_path / "poisoned", rank=4, modules=("o_proj",))
    tensors = load_file(poisoned / "adapter_model.safetensors")
    next(iter(tensors.values()))[0, 0] = float("nan")
    save_file(tensors, poisoned / "adapter_model.safetensors")
    cases = {"wide": "exceeds max_lora_rank=4", "poisoned": "not all finite", "head": "not an adapter of an attention or dense MLP",
             "other": "an adapter for another model", "half": "without its other half",
             "missing": "has no adapter_config.json"}
    for adapter, reason in cases.items():
        lora = LoRARequest(adapter, str(tmp_path / adapter))
        with pytest.raises(ValueError, match=reason):
            llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)
        assert llm.stats()["kv_blocks_used"] == 0
    good, merged = adapters["attention"]
    check(llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=good), [prompt["prompt_token_ids"]], merged,
          "a good adapter after the bad ones")


def test_lora_requests_are_refused_without_enable_lora(llama_dir, adapters):
    llm = LLM(str(llama_dir))
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        llm.generate("hello", GREEDY, use_tqdm=False, lora_request=adapters["every"][0])
    with pytest.raises(ValueError, match="one LoRARequest or None per prompt"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, lora_request=[adapters["every"][0]])


@pytest.mark.parametrize("extra, reason", [
    ({"use_dora": True}, "DoRA"), ({"bias": "all"}, "trained biases"), ({"modules_to_save": ["lm_head"]},
                                                                        "modules_to_save"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"), ({"target_modules": ["q_proj", "embed_tokens"]},
                                                        "embed_tokens are not supported"),
    ({"peft_type": "IA3"}, "only LORA"), ({"r": 0}, "r must be a positive integer"),
    ({"lora_alpha": "x"}, "lora_alpha must be a positive number"),
])
def test_adapter_configs_the_worker_cannot_apply_are_refused_by_name(llama_dir, tmp_path, extra, reason):
    adapter = make_adapter(llama_dir, tmp_path / "a", rank=4, modules=("q_proj",), config_extra=extra)
    with pytest.raises(ValueError, match=reason):
        read_adapter_config(adapter)


def test_adapter_config_defaults_and_engine_limits(llama_dir, tmp_path):
    adapter = make_adapter(llama_dir, tmp_path / "a", rank=4, alpha=8, modules=("q_proj", "v_proj"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_modules"] = "model.*(q_proj|v_proj)"  # a pattern: the weights' names decide
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    read = read_adapter_config(adapter)
    assert (read.rank, read.scaling, read.target_modules) == (4, 2.0, frozenset())
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(max_loras=0)
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineConfig(max_lora_rank=1024)
    with pytest.raises(ValueError, match="needs a name"):
        LoRARequest("", str(adapter))
    # vLLM's form: (lora_name, lora_int_id, lora_path); the id is not the identity.
    vllm_style = LoRARequest("a", 7, str(adapter))
    assert vllm_style == LoRARequest("a", str(adapter)) == LoRARequest(lora_name="a", lora_path=str(adapter))
    assert (vllm_style.lora_name, vllm_style.lora_int_id, vllm_style.lora_path) == ("a", 7, str(adapter))
    # Keys cannot run into one another: a salt that spells an adapter's key is another key.
    from services.scheduler.sequence import Sequence
    salted = Sequence(0, EngineRequest("r", [1], GREEDY, cache_salt=LoRARequest("a", "/p").cache_key.decode()), 0, 4, 0)
    adapted = Sequence(0, EngineRequest("r", [1], GREEDY, lora=LoRARequest("a", "/p")), 0, 4, 0)
    assert salted.cache_extra != adapted.cache_extra


def test_lora_layers_equal_the_merged_matmul_in_bfloat16_to_rounding(llama_dir, adapters):
    """The math itself, one layer, away from greedy ties: x W^T + scaling (x A^T) B^T per token's slot."""
    from services.worker.lora_adapters import AdapterSlots
    from services.worker.model_loader import load_model
    from services.worker.tensor_parallel import TensorParallel

    model, _ = load_model(llama_dir, torch.bfloat16, torch.device("cpu"), tp=TensorParallel())
    slots = AdapterSlots(model, num_slots=2, max_rank=8, tp=TensorParallel())
    every, attention = adapters["every"][0], adapters["attention"][0]
    assigned, failed = slots.slots_for([attention, None, every])
    assert not failed and sorted(s for s in assigned if s is not None) == [0, 1]
    qkv = model.layers[1].self_attn.qkv_proj
    x = torch.randn(6, 64).to(torch.bfloat16)
    slots.batch.set_token_slots(assigned, [2, 2, 2])
    ours = qkv(x).float()
    adapter = load_file(f"{every.path}/adapter_model.safetensors")
    a = adapter["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"]
    b = adapter["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"]
    base = qkv.base(x).float()
    k = slice(64, 96)  # q: 4 heads of 16, then k: 2 heads of 16
    expected = base[4:, k] + 2.0 * (x[4:].float() @ a.T) @ b.T
    torch.testing.assert_close(ours[4:, k], expected, atol=0.05, rtol=0.02)
    torch.testing.assert_close(ours[2:4], base[2:4])  # no adapter: the base layer's own output
    # One adapter alone (slot 1: the step's matmuls cover only it): its tokens as when both ran.
    assert assigned[0] == 1
    slots.batch.set_token_slots([assigned[0], None], [2, 4])
    alone = qkv(x).float()
    torch.testing.assert_close(alone[:2], ours[:2])
    torch.testing.assert_close(alone[2:], base[2:])
    # Another slot's product overflowing (inf) reaches no other token: selected, not multiplied by 0.
    qkv.lora_a[qkv._rows(assigned[2], 0)] = float("inf")
    slots.batch.set_token_slots([assigned[0], None, assigned[2]], [2, 2, 2])
    spoiled = qkv(x).float()
    torch.testing.assert_close(spoiled[:4], ours[:4])
    slots.batch.clear()
    torch.testing.assert_close(qkv(x), qkv.base(x))


@pytest.mark.parametrize("host_blocks", [0, 64])  # preempted by recompute, or swapped out and back
def test_no_step_runs_more_adapters_than_max_loras_and_every_request_ends(host_blocks):
    import dataclasses

    from services.scheduler.engine_core import EngineCore
    from services.scheduler.executor import InProcessExecutor
    from services.scheduler.scheduler import SchedulerLimits
    from tests.fake_worker import FakeWorker
    from tests.pipeline import Pipeline

    worker = FakeWorker(num_blocks=24, block_size=4, num_cpu_blocks=host_blocks)
    worker.info = dataclasses.replace(worker.info, max_loras=2, max_lora_rank=8)
    limits = SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=32, enable_chunked_prefill=True)
    engine = EngineCore(InProcessExecutor(worker), limits, watermark=0.0, enable_prefix_caching=True)
    loras = [None] + [LoRARequest(f"a{i}", f"/adapters/{i}") for i in range(4)]
    rng = random.Random(9)
    for i in range(40):
        engine.add_request(EngineRequest(f"r{i}", [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))],
                                         SamplingParams(max_tokens=rng.randrange(1, 12), n=rng.choice([1, 1, 2])),
                                         lora=rng.choice(loras)))
    pipeline, finished = Pipeline(engine), set()
    while pipeline.has_unfinished():
        finished |= {u.request_id for u in pipeline.step() if u.finish_reason}
    adapter_of = {}
    for plan in worker.plans:
        adapter_of.update({fork.child_seq_id: adapter_of[fork.parent_seq_id] for fork in plan.forks})
        adapter_of.update({new.seq_id: new.lora for new in plan.new})
        in_step = {adapter_of[s] for s in [*(n.seq_id for n in plan.new), *(r.seq_id for r in plan.running)]}
        assert len(in_step - {None}) <= 2, f"step {plan.step_id} ran adapters {in_step}"
    assert finished == {f"r{i}" for i in range(40)}
    assert engine.scheduler.num_preemptions > 0, "meant to preempt"
    assert (engine.scheduler.num_swaps_in > 0) == bool(host_blocks)
    assert engine.scheduler.blocks.num_used_blocks == 0


def test_lora_modules_flag_entries_and_their_errors(tmp_path, monkeypatch):
    from pagedserve.launcher import build_parser as serve_parser
    from pagedserve.launcher import lora_modules_error
    from services.gateway.lora_modules import LoRAModule, adapters_for, parse_lora_modules

    parsed = parse_lora_modules(["sql=/a/sql", ' {"name": "chat", "path": "/a/chat", "base_model_name": "hub/base"} '])
    assert parsed == [LoRAModule(LoRARequest("sql", "/a/sql")), LoRAModule(LoRARequest("chat", "/a/chat"), "hub/base")]
    assert adapters_for(("base",), parsed, max_loras=1) == {"sql": parsed[0], "chat": parsed[1]}
    for entries, reason in [(["sql"], "name=path or a JSON"), (["=/a"], "name=path"), (["{nope"], "not valid JSON"),
                            (['{"name": "x"}'], "takes name, path"), (['{"name": "x", "path": "/p", "r": 1}'],
                                                                     "takes name, path"),
                            (["a=/1", "a=/2"], "names a more than once")]:
        with pytest.raises(ValueError, match=reason):
            parse_lora_modules(entries)
    assert adapters_for(("base", "sql"), parsed, max_loras=1) == {"chat": parsed[1]}  # unreachable: left out, logged
    serve = serve_parser()
    args = serve.parse_args(["--lora-modules", "a=/1", "b=/2", "--enable-lora"])
    assert "--lora-modules a=/1 --lora-modules b=/2" in " ".join(serve.argv_for("gateway", args))
    assert "--enable-lora" in serve.argv_for("worker", args)
    assert "has no adapter_config.json" in lora_modules_error([f"a={tmp_path}"], 16)
    # From the environment: comma-separated, or a JSON list (whose entries may hold commas).
    from services.gateway.server import build_parser
    from shared.option_env import apply_env_defaults
    for raw, expected in [("a=/1, b=/2", ["a=/1", "b=/2"]),
                          ('["a=/1,x", {"name": "b", "path": "/2"}]', ["a=/1,x", '{"name": "b", "path": "/2"}'])]:
        parser = build_parser()
        monkeypatch.setenv("PAGEDSERVE_LORA_MODULES", raw)
        apply_env_defaults(parser)
        assert parser.parse_args([]).lora_modules == expected
