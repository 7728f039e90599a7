"""The worker: model weights, KV pools, attention and sampler; executes step plans exactly as told."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from services.worker.attention.selector import select_attention_backend
from services.worker.input_batch import ScheduledSequence, build_model_inputs
from services.worker.kv_cache import allocate_kv_pools, num_kv_blocks
from services.worker.model_loader import load_eos_token_ids, load_model
from services.worker.sampler import Sampler, SamplingState
from shared.config import EngineConfig
from shared.model_config import ModelConfig
from shared.model_factory import default_model_dir
from shared.step_protocol import NewSequence, SequenceOutput, StepPlan, StepResult, WorkerInfo

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WorkerSequence:
    """The worker's copy of one sequence, kept between steps so plans carry only deltas."""

    def __init__(self, new: NewSequence, vocab_size: int):
        self.seq_id = new.seq_id
        self.prompt_len = len(new.prompt_token_ids)
        self.token_ids = list(new.prompt_token_ids) + list(new.output_token_ids)
        self.block_table = list(new.block_table)
        self.num_computed_tokens = new.num_computed_tokens
        self.params = new.sampling_params
        self.sampling = SamplingState(new.sampling_params, new.prompt_token_ids, new.output_token_ids,
                                      vocab_size, stream_index=new.index)

    def append_tokens(self, token_ids: list[int]) -> None:
        self.token_ids.extend(token_ids)
        for token in token_ids:
            self.sampling.append(token)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for, but CUDA is not available")
    return device


class Worker:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.model_dir = Path(config.model) if config.model else default_model_dir()
        self.model_config = ModelConfig.from_model_dir(self.model_dir)
        self.dtype = DTYPES[self.model_config.dtype if config.dtype == "auto" else config.dtype]
        self.model, self.model_config = load_model(self.model_dir, self.dtype, self.device)
        self.max_model_len = self._resolve_max_model_len()
        token_budget = config.token_budget(self.max_model_len)
        self.num_blocks = num_kv_blocks(self.model_config, config, self.device, self.dtype, token_budget,
                                        self.max_model_len)
        self.kv_pools = allocate_kv_pools(self.model_config, self.num_blocks, config.block_size, self.dtype,
                                          self.device)
        backend = select_attention_backend(config.attention_backend, self.device)
        self.attention = backend(self.kv_pools, self.model_config.head_dim ** -0.5)
        self.eos_token_ids = load_eos_token_ids(self.model_dir)
        self.vocab_size = self.model_config.vocab_size
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids, seed=config.seed, device=self.device)
        self.seqs: dict[int, WorkerSequence] = {}

    def _resolve_max_model_len(self) -> int:
        model = self.model_config
        limit = model.max_position_embeddings
        if model.sliding_window is not None:
            # Attention here is full, not windowed: serve only lengths where the two agree.
            limit = min(limit, model.sliding_window)
        wanted = self.config.max_model_len
        if wanted is not None and wanted > limit:
            raise ValueError(f"max_model_len={wanted} exceeds what the model at {self.model_dir} supports ({limit})")
        return wanted or limit

    @property
    def info(self) -> WorkerInfo:
        return WorkerInfo(model=str(self.model_dir), num_kv_blocks=self.num_blocks, block_size=self.config.block_size,
                          max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                          eos_token_ids=tuple(self.eos_token_ids), device=str(self.device),
                          dtype=str(self.dtype).removeprefix("torch."))

    # --- one step ---------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        batch = self._apply_plan(plan)
        if not batch:
            return StepResult(step_id=plan.step_id)
        started = time.perf_counter()
        with torch.inference_mode():
            hidden = self._forward(batch)
            forward_done = self._synchronize()
            outputs = self._sample(batch, hidden)
        for seq, num_tokens in batch:
            seq.num_computed_tokens += num_tokens
        sample_done = self._synchronize()
        return StepResult(step_id=plan.step_id, outputs=outputs, forward_time_s=forward_done - started,
                          sample_time_s=sample_done - forward_done)

    def _apply_plan(self, plan: StepPlan) -> list[tuple[WorkerSequence, int]]:
        batch = []
        for new in plan.new:
            seq = WorkerSequence(new, self.vocab_size)
            self.seqs[new.seq_id] = seq
            batch.append((seq, new.num_scheduled_tokens))
        for delta in plan.running:
            seq = self.seqs.get(delta.seq_id)
            if seq is None:
                raise ValueError(f"step {plan.step_id}: sequence {delta.seq_id} is unknown to this worker")
            seq.append_tokens(delta.new_token_ids)
            seq.block_table.extend(delta.new_block_ids)
            if seq.num_computed_tokens != delta.num_computed_tokens:
                raise ValueError(f"step {plan.step_id}: sequence {delta.seq_id} has {seq.num_computed_tokens} "
                                 f"computed tokens here, the scheduler says {delta.num_computed_tokens}")
            batch.append((seq, delta.num_scheduled_tokens))
        return batch

    def _forward(self, batch: list[tuple[WorkerSequence, int]]) -> torch.Tensor:
        scheduled = [ScheduledSequence(seq.token_ids, seq.block_table, seq.num_computed_tokens, n) for seq, n in batch]
        inputs = build_model_inputs(scheduled, self.config.block_size, self.device)
        self._query_start = inputs.meta.query_start_loc.tolist()
        return self.model(inputs.input_ids, inputs.positions, self.attention, inputs.meta)

    def _sample(self, batch: list[tuple[WorkerSequence, int]], hidden: torch.Tensor) -> list[SequenceOutput]:
        """Logits only where needed: each finishing sequence's last token, and prompt rows asked for."""
        rows: list[int] = []
        sampling: list[tuple[int, WorkerSequence]] = []  # (batch index, seq) that sample a token
        prompt_rows: list[tuple[int, WorkerSequence, int, int]] = []  # (batch index, seq, first row, count)
        for i, (seq, num_tokens) in enumerate(batch):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_tokens
            if seq.params.prompt_logprobs is not None and start < seq.prompt_len - 1:
                count = min(end, seq.prompt_len - 1) - start
                prompt_rows.append((i, seq, len(rows), count))
                rows.extend(range(self._query_start[i], self._query_start[i] + count))
            if end == len(seq.token_ids):
                sampling.append((i, seq))
        sample_rows = [self._query_start[i + 1] - 1 for i, _ in sampling]
        involved = sorted({i for i, *_ in prompt_rows} | {i for i, _ in sampling})
        outputs = {i: SequenceOutput(seq_id=batch[i][0].seq_id, token_id=None) for i in involved}
        if prompt_rows:
            self._prompt_logprobs(hidden, rows, prompt_rows, outputs)
        if sampling:
            logits = self.model.compute_logits(hidden[sample_rows])
            sampled = self.sampler.sample(logits, [seq.sampling for _, seq in sampling])
            for (i, _), (token_id, logprobs) in zip(sampling, sampled):
                outputs[i].token_id, outputs[i].logprobs = token_id, logprobs
        return [outputs[i] for i in sorted(outputs)]

    def _prompt_logprobs(self, hidden, rows, prompt_rows, outputs) -> None:
        logits = self.model.compute_logits(hidden[rows])
        for i, seq, first, count in prompt_rows:
            start = seq.num_computed_tokens
            targets = seq.token_ids[start + 1:start + 1 + count]
            outputs[i].prompt_logprobs = self.sampler.prompt_logprobs(
                logits[first:first + count], targets, seq.params.prompt_logprobs)
            outputs[i].prompt_logprobs_start = start + 1

    def _synchronize(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
