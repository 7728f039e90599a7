"""Decode graphs (services/worker/cuda_graphs.py) on the CPU: the Triton kernels under the interpreter, and a
stand-in capturer that replays by running the captured function again on the same buffers, writing into
the same output. Real capture needs a GPU (benchmarks/gpu_kernels.py runs the engine with it); what is
checked here is everything around it: the buffers, the padding, the fixed launch plan, the dispatch."""

from __future__ import annotations

import os

# Whichever test module imports triton first decides interpreted or compiled for the whole session.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("these tests run the kernels on the CPU: they need TRITON_INTERPRET=1", allow_module_level=True)
if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7):
    pytest.skip(f"the Triton {triton.__version__} interpreter cannot run these kernels", allow_module_level=True)

from services.worker.attention.triton_attention import TritonAttentionBackend  # noqa: E402
from services.worker.block_moves import whole_pool  # noqa: E402
from services.worker.cuda_graphs import (  # noqa: E402
    SHORT_CONTEXT, DecodeGraphs, capture_decode_graphs, capture_sizes, check_decode_graphs, context_classes,
    random_decode_batch)
from services.worker.input_batch import ScheduledSequence, build_model_inputs  # noqa: E402
from services.worker.kv_cache import allocate_kv_pools  # noqa: E402
from services.worker.model_loader import load_model  # noqa: E402

CPU = torch.device("cpu")
BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN = 16, 160, 1024  # at the full length 1 and 2 sequences split, 4 do not


class ReplayByRerunning:
    """Stands in for torch.cuda graphs: a replay runs the function again and writes the captured output."""

    def __init__(self):
        self.replays = 0

    def capture(self, fn):
        out = fn()

        def replay():
            self.replays += 1
            out.copy_(fn())

        return replay, out


class FrozenReplay:
    """A broken capture: replays change nothing, as if the inputs had been baked in."""

    def capture(self, fn):
        return (lambda: None), fn()


@pytest.fixture(scope="module")
def long_llama_dir(tiny_model_factory):
    return tiny_model_factory("llama", max_position_embeddings=MAX_MODEL_LEN)


def model_and_backend(model_dir):
    model, config = load_model(model_dir, torch.float32, CPU)
    pools = allocate_kv_pools(config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, CPU)
    pools[0][0].normal_()  # stale contents, which padding must neither disturb nor be hurt by
    return model, config, TritonAttentionBackend(pools, model.attention_spec()), pools


def capture(model, backend, capturer, max_num_seqs=4, lora=None) -> DecodeGraphs:
    with torch.inference_mode():
        return capture_decode_graphs(model, backend, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                                     max_num_seqs=max_num_seqs, device=CPU, capturer=capturer, lora=lora)


def eager(model, backend, batch):
    inputs = build_model_inputs(batch, BLOCK_SIZE, CPU)
    with torch.inference_mode():
        return model(inputs.input_ids, inputs.positions, backend, inputs.meta)


def test_context_classes():
    assert SHORT_CONTEXT == 255  # the longest the split heuristic never splits
    assert context_classes(200) == [200]
    assert context_classes(255) == [255]
    assert context_classes(32768) == [255, 32768]


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(10_000)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))


def test_replays_equal_the_eager_pass_and_padding_writes_nothing(long_llama_dir):
    model, config, backend, pools = model_and_backend(long_llama_dir)
    capturer = ReplayByRerunning()
    graphs = capture(model, backend, capturer)
    assert graphs.sizes == [1, 2, 4] and graphs.contexts == [SHORT_CONTEXT, MAX_MODEL_LEN]
    plans = {key: graph.plan for key, graph in graphs.graphs.items()}
    assert plans[1, MAX_MODEL_LEN].split and plans[2, MAX_MODEL_LEN].split and not plans[4, MAX_MODEL_LEN].split
    assert not any(plans[size, SHORT_CONTEXT].split for size in (1, 2, 4))  # short decodes never split
    g = torch.Generator().manual_seed(0)
    # A full batch first, so the padded ones after it find the last row's real inputs in the buffers.
    for n, longest in ((4, MAX_MODEL_LEN), (3, MAX_MODEL_LEN), (1, 40), (2, MAX_MODEL_LEN - 100), (3, 700)):
        batch = random_decode_batch(n, BLOCK_SIZE, NUM_BLOCKS, config.vocab_size, longest, g)
        expected_graph = ({1: 1, 2: 2, 3: 4, 4: 4}[n], MAX_MODEL_LEN if longest > SHORT_CONTEXT else SHORT_CONTEXT)
        assert graphs.graph_for(batch) == expected_graph
        before = whole_pool(pools).clone()
        replays = capturer.replays
        with torch.inference_mode():
            replayed = graphs.forward(batch).clone()
        assert capturer.replays == replays + 1 and replayed.shape == (n, config.hidden_size)
        written = whole_pool(pools).clone()
        slots = build_model_inputs(batch, BLOCK_SIZE, CPU).meta.slot_mapping
        changed = (written != before).flatten(4).any(-1)  # [layers, k/v, blocks, block_size]
        assert set(changed.any(0).any(0).flatten().nonzero().flatten().tolist()) == set(slots.tolist())
        expected = eager(model, backend, batch)  # its own plan, for this batch's lengths
        torch.testing.assert_close(replayed, expected, atol=1e-4, rtol=1e-4)


def test_replays_rotate_by_each_sequences_shifted_position(long_llama_dir):
    """M-RoPE's text after images (mrope.py) rotates at its index plus a shift: the graphs' buffers take it as the
    eager inputs do."""
    import dataclasses

    model, config, backend, _ = model_and_backend(long_llama_dir)
    graphs = capture(model, backend, ReplayByRerunning())
    batch = random_decode_batch(3, BLOCK_SIZE, NUM_BLOCKS, config.vocab_size, 600, torch.Generator().manual_seed(1))
    shifted = [dataclasses.replace(s, rope_offset=-(s.num_computed_tokens // 3)) for s in batch]
    with torch.inference_mode():
        replayed = graphs.forward(shifted).clone()
    torch.testing.assert_close(replayed, eager(model, backend, shifted), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(replayed, eager(model, backend, batch), atol=1e-3)


def test_only_decodes_up_to_the_largest_graph_replay(long_llama_dir):
    model, _, backend, _ = model_and_backend(long_llama_dir)
    graphs = capture(model, backend, ReplayByRerunning(), max_num_seqs=2)
    decode = ScheduledSequence([1, 2, 3], [0], 2, 1)
    assert graphs.can_replay([decode]) and graphs.can_replay([decode, decode])
    assert not graphs.can_replay([decode] * 3)  # past the largest graph
    assert not graphs.can_replay([decode, ScheduledSequence([1, 2, 3], [0], 1, 2)])  # a prefill chunk
    assert not graphs.can_replay([])
    wider = ScheduledSequence([1, 2, 3], [0] * (MAX_MODEL_LEN // BLOCK_SIZE + 1), 2, 1)
    assert not graphs.can_replay([wider])  # more blocks than the buffers hold


def test_check_passes_faithful_graphs_and_catches_frozen_ones(long_llama_dir):
    model, config, backend, _ = model_and_backend(long_llama_dir)
    options = dict(num_blocks=NUM_BLOCKS, vocab_size=config.vocab_size, dtype=torch.float32, device=CPU)
    with torch.inference_mode():
        good = capture(model, backend, ReplayByRerunning(), max_num_seqs=2)
        assert check_decode_graphs(good, model, backend, **options) < 1e-4  # float32; split or not
        frozen = capture(model, backend, FrozenReplay(), max_num_seqs=2)
        with pytest.raises(ValueError, match="for 1 sequences up to 255 keys differs from the eager forward pass"):
            check_decode_graphs(frozen, model, backend, **options)


def test_engine_greedy_tokens_equal_with_and_without_graphs(long_llama_dir):
    from pagedserve import LLM, SamplingParams

    prompts = [[5, 17, 99, 3, 250, 41, 8, 77, 12], [42, 7, 19], list(range(100, 130))]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    results = {}
    for graphs in (False, True):
        llm = LLM(str(long_llama_dir), block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS,
                  attention_backend="triton")
        worker = llm.engine.executor.worker
        assert worker.decode_graphs is None  # a CPU worker never captures on its own
        capturer = ReplayByRerunning()
        if graphs:
            worker.decode_graphs = capture(worker.model, worker.attention, capturer)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[graphs] = [o.outputs[0].token_ids for o in outputs]
        assert (capturer.replays > 0) == graphs
    assert results[True] == results[False]


def random_adapters(model, num_slots: int, rank: int, seed: int):
    """Adapter layers on the model, every slot holding random weights that change its outputs."""
    batch, _ = model.add_lora(num_slots, rank)
    g = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if hasattr(module, "lora_a"):
            module.lora_a.copy_(torch.randn(module.lora_a.shape, generator=g) * 0.2)
            module.lora_b.copy_(torch.randn(module.lora_b.shape, generator=g) * 0.2)
    return batch


def test_replays_run_each_rows_own_adapter(long_llama_dir):
    """Captured over every slot, a graph serves any mix of adapters: each row its own (padding and rows
    without one: none), as the eager pass runs the step's."""
    model, config, backend, _ = model_and_backend(long_llama_dir)
    lora = random_adapters(model, num_slots=3, rank=4, seed=2)
    graphs = capture(model, backend, ReplayByRerunning(), max_num_seqs=4, lora=lora)
    assert graphs.lora is lora and graphs.buffers.lora_mask.shape == (4, 3)
    g = torch.Generator().manual_seed(3)
    # (Contexts of one key, where rows see nothing of each other, then longer ones, split.)
    for n, slots, longest in ((4, [2, None, 0, 1], 1), (3, [None, 1, 1], 1), (2, [0, 2], MAX_MODEL_LEN)):
        batch = random_decode_batch(n, BLOCK_SIZE, NUM_BLOCKS, config.vocab_size, longest, g)
        lora.set_token_slots(slots, [1] * n)
        with torch.inference_mode():
            replayed = graphs.forward(batch).clone()
        expected = eager(model, backend, batch)
        torch.testing.assert_close(replayed, expected, atol=1e-4, rtol=1e-4)
        lora.clear()
        if longest == 1:
            base = eager(model, backend, batch)
            for row, slot in enumerate(slots):  # the adapters matter, row by row
                assert torch.allclose(expected[row], base[row], atol=1e-3) == (slot is None)
    options = dict(num_blocks=NUM_BLOCKS, vocab_size=config.vocab_size, dtype=torch.float32, device=CPU)
    single = capture(model, backend, ReplayByRerunning(), max_num_seqs=1, lora=lora)  # (the check's random slots)
    with torch.inference_mode():
        assert check_decode_graphs(single, model, backend, **options) < 1e-4
    assert lora.mask is None  # the check leaves no slots set


def _replay_on_rank(rank: int, model_dir: str, rendezvous: str, out_dir: str) -> None:
    """One of two tensor-parallel ranks (gloo): graphs captured with their all-reduces, checked, replayed."""
    from services.worker.tensor_parallel import join_group, leave_group

    tp = join_group(rank, 2, rendezvous, CPU)
    try:
        model, config = load_model(model_dir, torch.float32, CPU, tp=tp)
        pools = allocate_kv_pools(config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, CPU)
        backend = TritonAttentionBackend(pools, model.attention_spec())
        graphs = capture(model, backend, ReplayByRerunning(), max_num_seqs=1)
        options = dict(num_blocks=NUM_BLOCKS, vocab_size=config.vocab_size, dtype=torch.float32, device=CPU)
        with torch.inference_mode():
            error = check_decode_graphs(graphs, model, backend, **options)
            assert tp.all_agree(error < 1e-4, CPU)
            batch = random_decode_batch(1, BLOCK_SIZE, NUM_BLOCKS, config.vocab_size, 1, torch.Generator())
            torch.save(graphs.forward(batch).clone(), f"{out_dir}/rank{rank}.pt")
    finally:
        leave_group(tp)


def test_replays_under_tensor_parallelism_equal_the_whole_model(long_llama_dir, tmp_path):
    """Two ranks capture the same graphs, all-reduces inside, and agree; their replays equal the whole
    model's eager pass on one rank."""
    import torch.multiprocessing as mp

    mp.start_processes(_replay_on_rank, args=(str(long_llama_dir), f"file://{tmp_path}/rendezvous", str(tmp_path)),
                       nprocs=2, start_method="spawn")
    model, config, backend, _ = model_and_backend(long_llama_dir)
    batch = random_decode_batch(1, BLOCK_SIZE, NUM_BLOCKS, config.vocab_size, 1, torch.Generator())
    expected = eager(model, backend, batch)  # a one-key context: what the ranks' pools hold beside does not matter
    for rank in (0, 1):
        torch.testing.assert_close(torch.load(tmp_path / f"rank{rank}.pt"), expected, atol=1e-4, rtol=1e-4)


def test_engine_greedy_tokens_with_adapters_equal_with_and_without_graphs(long_llama_dir, tmp_path):
    from pagedserve import LLM, LoRARequest, SamplingParams
    from tests.lora_adapters import make_adapter

    adapters = [LoRARequest(name, str(make_adapter(long_llama_dir, tmp_path / name, rank=4, seed=seed, std=0.3)))
                for seed, name in enumerate(("one", "two"))]
    prompts = [[5, 17, 99, 3, 250, 41, 8, 77, 12], [42, 7, 19], list(range(100, 130)), [9, 9, 8]]
    loras = [adapters[0], None, adapters[1], adapters[0]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    results = {}
    for graphs in (False, True):
        llm = LLM(str(long_llama_dir), block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS,
                  attention_backend="triton", enable_lora=True, max_loras=2, max_lora_rank=4)
        worker = llm.engine.executor.worker
        capturer = ReplayByRerunning()
        if graphs:
            worker.decode_graphs = capture(worker.model, worker.attention, capturer, lora=worker.adapters.batch)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                               lora_request=loras)
        results[graphs] = [o.outputs[0].token_ids for o in outputs]
        assert (capturer.replays > 0) == graphs
    assert results[True] == results[False]
    without = LLM(str(long_llama_dir), block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS)
    plain = without.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] != results[True]  # the adapters change the tokens
