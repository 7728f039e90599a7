"""The largest step a worker can be sent, run once at start to measure its transient device memory.

The KV budget sets aside ``activation_bytes_estimate`` (kv_cache.py) for one step's forward pass and
sampling. A CUDA worker then runs the largest step its limits allow, while its pool is still empty:
the whole token budget as prompts as long as the context allows, then the logits of ``max_num_seqs``
rows through the sampler's most expensive path (penalties, top-k, top-p, min-p, logprobs, seeds): the
worker samples at most that many rows at a time, however many forked siblings a step holds. A step
that does not fit fails here, at start, rather than inside some request's step; one that fits
leaves its memory cached in torch's allocator for the real ones. The peak it measured is reported
beside the estimate. (Prompt logprobs take logits for at most ``max_num_seqs`` rows at a time, and
a cheaper path than this one.)
"""

from __future__ import annotations

import torch

from services.worker.input_batch import ScheduledSequence, build_model_inputs
from services.worker.kernel_warmup import dummy_sequence
from services.worker.sampler import Sampler, SamplingState
from shared.sampling_params import SamplingParams


def largest_step_batch(block_size: int, num_blocks: int, max_model_len: int, token_budget: int,
                       max_num_seqs: int) -> list[ScheduledSequence]:
    """First chunks of prompts, each as long as the context allows, until the budget is spent."""
    batch: list[ScheduledSequence] = []
    left = token_budget
    while left > 0 and len(batch) < max_num_seqs:
        tokens = min(left, max_model_len)
        batch.append(dummy_sequence(0, tokens, block_size, num_blocks))
        left -= tokens
    return batch


def costliest_sampling(vocab_size: int, max_logprobs: int, device: torch.device) -> SamplingState:
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                            frequency_penalty=0.5, presence_penalty=0.5, logprobs=max_logprobs, seed=0)
    return SamplingState(params, [0], [], vocab_size, device=device)


def run_largest_step(model, attention, sampler: Sampler | None, *, block_size: int, num_blocks: int, max_model_len: int,
                     token_budget: int, max_num_seqs: int, max_logprobs: int, device: torch.device) -> int | None:
    """Runs the step; on CUDA returns its peak allocation above what was allocated before it. Without a
    sampler (a pooling model) the forward pass alone."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    batch = largest_step_batch(block_size, num_blocks, max_model_len, token_budget, max_num_seqs)
    with torch.inference_mode():
        inputs = build_model_inputs(batch, block_size, device)
        hidden = model(inputs.input_ids, inputs.positions, attention, inputs.meta)
        if sampler is None:
            return _peak(device, before) if cuda else None
        rows = [i % hidden.shape[0] for i in range(max_num_seqs)]
        states = [costliest_sampling(sampler.vocab_size, max_logprobs, device) for _ in rows]
        sampler.sample(model.compute_logits(hidden[rows]), states)
    return _peak(device, before) if cuda else None


def _peak(device: torch.device, before: int) -> int:
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
