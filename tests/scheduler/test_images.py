"""Images as the scheduler sees them: a step starts at most an encoder budget of image features (a chunk
stops before an image it cannot afford, the step's first image always goes), and the prefix cache tells one
image from another by hash. On the fake worker, whose tokens depend only on the sequence."""

from __future__ import annotations

import pytest

from services.scheduler.engine_core import EngineCore
from services.scheduler.executor import InProcessExecutor
from services.scheduler.scheduler import SchedulerLimits
from shared.multimodal import ImageInput, pixels_hash
from shared.request import EngineRequest
from shared.sampling_params import SamplingParams
from tests.fake_worker import FakeWorker

IMAGE = 99  # the placeholder token


def image(seed: int, offset: int, length: int) -> ImageInput:
    data = bytes([seed]) * 12
    return ImageInput(hash=pixels_hash(data, (3,), "float32"), offset=offset, length=length, pixel_values=data,
                      shape=(3,))


def engine(budget: int, chunked: bool = True, whole_images: bool = False, num_blocks: int = 64,
           host_blocks: int = 0, preemption_mode: str | None = None) -> tuple[EngineCore, FakeWorker]:
    worker = FakeWorker(num_blocks, 4, vocab_size=200, image_token_id=IMAGE, whole_images=whole_images,
                        num_cpu_blocks=host_blocks)
    limits = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                             preemption_mode=preemption_mode)
    return EngineCore(InProcessExecutor(worker), limits), worker


def request(request_id: str, images: list[ImageInput], length: int, max_tokens: int = 3) -> EngineRequest:
    prompt = [5 + i % 7 for i in range(length)]
    for img in images:
        prompt[img.offset:img.end] = [IMAGE] * img.length
    return EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                         images=tuple(images))


def run(core: EngineCore) -> None:
    for _ in range(200):
        if not core.has_unfinished():
            return
        core.step()
    raise AssertionError("the engine stalled")


def started_images(worker: FakeWorker, requests: dict[int, EngineRequest]) -> list[list[int]]:
    """Per step, the rows of features of each image whose placeholders it starts."""
    steps = []
    for plan in worker.plans:
        chunks = [(new.seq_id, new.num_computed_tokens, new.num_scheduled_tokens) for new in plan.new]
        chunks += [(d.seq_id, d.num_computed_tokens, d.num_scheduled_tokens) for d in plan.running]
        steps.append([img.length for seq_id, start, n in chunks for img in requests[seq_id].images
                      if start <= img.offset < start + n])
    return steps


@pytest.mark.parametrize("budget, images", [
    (6, [(1, 2), (3, 9), (13, 3)]),  # the second starts in the first chunk but reaches far past it
    (10, [(2, 4), (8, 9), (19, 5)]),
    (16, [(0, 6), (6, 6), (12, 6)])])
def test_a_step_starts_images_within_its_encoder_budget(budget, images):
    core, worker = engine(budget)
    sent = {0: request("a", [image(i + 1, offset, length) for i, (offset, length) in enumerate(images)], 30),
            1: request("b", [image(9, 0, 4)], 8)}
    for req in sent.values():
        core.add_request(req)
    run(core)
    steps = started_images(worker, sent)
    assert all(sum(rows) <= budget or len(rows) == 1 for rows in steps), steps  # (one larger goes alone)
    assert sum(map(sum, steps)) == sum(length for _, length in images) + 4  # every image started once


def test_an_image_larger_than_the_budget_still_goes_alone():
    core, worker = engine(4)
    core.add_request(request("big", [image(5, 1, 9)], 12))
    run(core)
    assert [9] in started_images(worker, {0: request("big", [image(5, 1, 9)], 12)})


def chunks(worker: FakeWorker) -> list[tuple[int, int, int]]:
    """(sequence, first position, tokens) of every prompt chunk the worker was sent."""
    out = [(new.seq_id, new.num_computed_tokens, new.num_scheduled_tokens) for plan in worker.plans for new in plan.new]
    return out + [(d.seq_id, d.num_computed_tokens, d.num_scheduled_tokens) for plan in worker.plans
                  for d in plan.running]


@pytest.mark.parametrize("budget", [4, 5, 7, 9])
def test_images_that_attend_both_ways_are_never_cut(budget):
    """Gemma 3's: no chunk ends inside an image, whatever the budget (at least the longest image), the prefix
    cache's hits included; every sequence still finishes."""
    core, worker = engine(budget, whole_images=True)
    layouts = {"a": [(1, 4), (6, 3), (13, 4)], "b": [(0, 4), (4, 4)], "c": [(9, 2)]}
    sent = {}
    for seq_id, (request_id, layout) in enumerate(layouts.items()):
        sent[seq_id] = request(request_id, [image(i + 1, offset, length) for i, (offset, length) in enumerate(layout)],
                               20)
        core.add_request(sent[seq_id])
    run(core)
    sent[3] = request("again", [image(i + 1, offset, length) for i, (offset, length) in enumerate(layouts["a"])], 20)
    core.add_request(sent[3])
    run(core)
    assert (3, 16) in [(seq_id, start) for seq_id, start, _ in chunks(worker)]  # a hit that ends inside (13, 4)
    for seq_id, start, n in chunks(worker):
        for img in sent[seq_id].images:
            assert not img.offset < start + n < img.end, (seq_id, start, n, img.offset, img.end)
    assert core.get_stats()["kv_blocks_used"] == 0


def test_a_swapped_in_sequence_never_cuts_an_image_either():
    """Sequences preempted by swap mid-prefill come back within the same rules."""
    core, worker = engine(5, whole_images=True, num_blocks=10, host_blocks=64, preemption_mode="swap")
    sent = {}
    for seq_id in range(4):
        layout = [(1 + seq_id, 4), (9, 4), (15, 3)]
        sent[seq_id] = request(f"r{seq_id}", [image(i + 1, o, n) for i, (o, n) in enumerate(layout)], 20, 12)
        core.add_request(sent[seq_id])
    run(core)
    assert core.scheduler.num_swaps_in > 0
    for seq_id, start, n in chunks(worker):
        for img in sent[seq_id].images:
            assert not img.offset < start + n < img.end, (seq_id, start, n, img.offset, img.end)


def test_an_image_that_attends_both_ways_must_fit_the_step():
    from shared.invalid_parameter import InvalidParameter

    core, _ = engine(4, whole_images=True)
    with pytest.raises(InvalidParameter, match="raise --max-num-batched-tokens"):
        core.add_request(request("big", [image(5, 1, 5)], 12))
    cut, _ = engine(4)  # an image that attends causally may be cut: any length goes
    cut.add_request(request("big", [image(5, 1, 5)], 12))
    run(cut)


def test_the_prefix_cache_tells_images_apart():
    core, worker = engine(64)
    for request_id, seed in (("first", 1), ("same", 1), ("other", 2)):
        core.add_request(request(request_id, [image(seed, 4, 8)], 24))
        run(core)
    starts = [new.num_computed_tokens for plan in worker.plans for new in plan.new]
    assert starts == [0, 20, 4]  # a hit up to the last block; another image: only the text before it


def test_the_gateway_routes_by_the_keys_the_scheduler_indexes():
    from services.gateway.prefix_routing import prompt_keys

    core, _ = engine(64)
    routed = request("routed", [image(3, 4, 8)], 24)
    core.add_request(routed)
    run(core)
    keys = prompt_keys(routed, 4)
    assert len(keys) == 5 and set(keys) <= set(core.cached_keys())  # the image's blocks and those after it too
