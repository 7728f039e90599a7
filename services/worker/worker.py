"""The worker: model weights, KV pools, attention and sampler; executes step plans exactly as told."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from services.worker.attention.cpu_kernels import cpu_kernels_unavailable_reason
from services.worker.attention.selector import select_attention_backend
from services.worker.attention.spec import kv_window
from services.worker.block_moves import copy_blocks_torch, swap_blocks, whole_pool
from services.worker.cpu_tuning import keep_large_allocations_in_heap
from services.worker.draft_model_proposer import DraftModel, DraftModelProposer, load_draft_model
from services.worker.grammar import Grammars
from services.worker.host_block_tables import HostBlockTables
from services.worker.input_batch import ScheduledSequence, build_model_inputs
from services.worker.lora_adapters import AdapterSlots
from services.worker.kv_cache import (activation_bytes_estimate, allocate_host_pool, allocate_kv_pools, bytes_per_block,
                                      num_host_blocks, num_kv_blocks)
from services.worker.model_loader import load_eos_token_ids, load_model
from services.worker.ngram_proposer import NgramProposer
from services.worker.pooler import Pooler
from services.worker.sampler import Sampler
from services.worker.step_timer import StepTimer
from services.worker.swap_staging import SwapStaging
from services.worker.tensor_parallel import TensorParallel, join_group
from services.worker.worker_sequence import WorkerSequence
from services.worker.model_config import ModelConfig
from services.worker.model_factory import default_model_dir
from shared.config import EngineConfig
from shared.pooling import read_pooler_config, resolve_runner
from shared.step_protocol import Sample, SequenceOutput, StepPlan, StepResult, WorkerInfo

if TYPE_CHECKING:
    from services.worker.cuda_graphs import DecodeGraphs

log = structlog.get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """The worker's device; a CUDA one always with its index, as its tensors report it."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for, but CUDA is not available")
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} was asked for, but there are {torch.cuda.device_count()} CUDA devices")
    return device


class Worker:
    def __init__(self, config: EngineConfig, tensor_parallel_rank: int = 0, distributed_init_method: str | None = None):
        """With config.tensor_parallel_size > 1, this is one rank of the workers that hold the model
        between them; they meet at ``distributed_init_method`` (tcp://host:port) before loading."""
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # Triton launches and timing events use the current device's stream
        self.model_dir = Path(config.model) if config.model else default_model_dir()
        self.model_config = ModelConfig.from_model_dir(self.model_dir)  # a bad directory fails before any build
        if self.device.type == "cpu":
            keep_large_allocations_in_heap()
            cpu_kernels_unavailable_reason()  # build (or load) the C++ kernels now, not inside the first step
        # A pooling model returns embeddings (or a classifier's class scores) instead of tokens
        # (shared/pooling.py): no logits head, no sampling.
        pooling = resolve_runner(config.runner, self.model_dir) == "pooling"
        self.pooler = Pooler(read_pooler_config(self.model_dir, self.model_config.hidden_size)) if pooling else None
        if pooling and config.speculative_config is not None:
            raise ValueError("speculative decoding is for generation: a pooling model (runner 'pooling') samples "
                             "no tokens to draft")
        self.dtype = DTYPES[self.model_config.dtype if config.dtype == "auto" else config.dtype]
        # A model the ranks cannot share is refused before they meet.
        TensorParallel(tensor_parallel_rank, config.tensor_parallel_size).shard(self.model_config)
        self.tp: TensorParallel = join_group(tensor_parallel_rank, config.tensor_parallel_size, distributed_init_method, self.device)
        # From here on model_config is this rank's share (its heads, KV pools and MLP columns), not the
        # whole model's; with one rank the two are the same.
        self.max_model_len = self._resolve_max_model_len()
        self.model, self.model_config = load_model(self.model_dir, self.dtype, self.device, tp=self.tp,
                                                   with_head=not pooling,
                                                   num_labels=len(self.pooler.config.labels) if pooling else 0,
                                                   max_model_len=self.max_model_len)
        # Room for the adapters is taken before the KV budget is measured.
        self.adapters = AdapterSlots(self.model, config.max_loras, config.max_lora_rank, self.tp) \
            if config.enable_lora else None
        token_budget = config.token_budget(self.max_model_len)
        spec = config.speculative_config
        # A draft model's weights load before the KV budget is measured, and each block holds its K/V too.
        draft = load_draft_model(spec.model, self.model_config, self.max_model_len, self.dtype, self.device) \
            if spec is not None and spec.method == "draft_model" else None
        draft_block_bytes = bytes_per_block(draft.config, config.block_size, self.dtype) if draft else 0
        scratch_bytes = draft_block_bytes * DraftModelProposer.num_scratch_blocks(
            spec.num_speculative_tokens, config.block_size, config.max_num_seqs) if draft else 0
        self.num_blocks = num_kv_blocks(self.model_config, config, self.device, self.dtype, token_budget,
                                        self.max_model_len, draft_block_bytes, scratch_bytes)
        self.kv_pools = allocate_kv_pools(self.model_config, self.num_blocks, config.block_size, self.dtype,
                                          self.device)
        self.kv_pool = whole_pool(self.kv_pools)
        self.num_host_blocks = num_host_blocks(self.model_config, config, self.dtype, self.num_blocks, draft_block_bytes)
        self.host_pool = allocate_host_pool(self.model_config, self.num_host_blocks, config.block_size, self.dtype)
        # Swaps with a GPU pass through a reused page-locked buffer; on a CPU both pools are host memory.
        if self.device.type == "cuda":
            staging = SwapStaging(pin=True)
            self._swap_out, self._swap_in = staging.swap_out, staging.swap_in
        else:
            self._swap_out = self._swap_in = swap_blocks
        backend = select_attention_backend(config.attention_backend, self.device)
        self.attention = backend(self.kv_pools, self.model.attention_spec())
        if backend.name == "triton":
            self.model.use_fused_experts()
        self.eos_token_ids = load_eos_token_ids(self.model_dir)
        self.vocab_size = self.model_config.vocab_size
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids, seed=config.seed, device=self.device)
        # Structured outputs: built on first use (the tokenizer, and xgrammar's compiler over it).
        self.grammars = Grammars(config.tokenizer or self.model_dir, self.vocab_size, self.eos_token_ids)
        self.proposer = self._make_proposer(draft, backend)  # drafts for the next step; None: no speculation
        # (device pool, host pool) pairs that every block move applies to: the target's, and a draft model's.
        self.pools = [(self.kv_pool, self.host_pool)]
        if isinstance(self.proposer, DraftModelProposer):
            self.pools.append((self.proposer.kv_pool, self.proposer.host_pool))
        self.kv_window = self._kv_window()  # reported: the scheduler frees blocks behind every layer's window
        self.startup_seconds: dict[str, float] = {}  # what a CUDA worker did before serving, and how long it took
        self.startup_memory: dict[str, int] = {}  # the largest step's measured peak beside what was set aside for it
        if self.device.type == "cuda":
            self._warm_up_kernels(token_budget)
            self._run_largest_step(token_budget)
        self.decode_graphs = self._capture_decode_graphs() if self._wants_cuda_graphs() else None
        self.seqs: dict[int, WorkerSequence] = {}
        self.block_tables = HostBlockTables(width=-(-self.max_model_len // config.block_size))
        self.step_timer = StepTimer(self.device)

    def _make_proposer(self, draft: DraftModel | None, attention_backend: type):
        spec, config = self.config.speculative_config, self.config
        if spec is None:
            return None
        if draft is None:
            return NgramProposer(spec)
        return DraftModelProposer(draft, spec.num_speculative_tokens, attention_backend, self.num_blocks,
                                  self.num_host_blocks, config.block_size, config.max_num_seqs, self.max_model_len,
                                  self.dtype, self.device)

    def _warm_up_kernels(self, token_budget: int) -> None:
        from services.worker.kernel_warmup import warm_up_kernels

        started = time.perf_counter()
        passes = warm_up_kernels(self.model, self.attention, self.kv_pool, self.config.block_size, self.max_model_len,
                                 token_budget, self.device)
        if isinstance(self.proposer, DraftModelProposer):  # the draft's shapes bring variants of their own
            draft = self.proposer
            passes += warm_up_kernels(draft.draft.model, draft.attention, draft.kv_pool, self.config.block_size,
                                      self.max_model_len, token_budget, self.device)
        self.startup_seconds["kernel_warm_up"] = self._synchronize() - started
        log.info("triton_kernels_warmed_up", forward_passes=passes, seconds=round(self.startup_seconds["kernel_warm_up"], 2))

    def _run_largest_step(self, token_budget: int) -> None:
        from services.worker.largest_step import run_largest_step

        config = self.config
        peak = run_largest_step(self.model, self.attention, self.sampler if self.pooler is None else None,
                                block_size=config.block_size, num_blocks=self.num_blocks,
                                max_model_len=self.max_model_len, token_budget=token_budget,
                                max_num_seqs=config.max_num_seqs, max_logprobs=config.max_logprobs, device=self.device)
        set_aside = activation_bytes_estimate(self.model_config, config, token_budget)
        self.startup_memory = {"largest_step_peak_bytes": peak, "set_aside_bytes": set_aside}
        fields = dict(peak_gib=round(peak / 2**30, 3), set_aside_gib=round(set_aside / 2**30, 3), tokens=token_budget)
        if peak > set_aside and config.num_gpu_blocks_override is None and config.kv_cache_memory_bytes is None:
            # It ran, with what is free now; less free later (another process) and a step fails.
            log.warning("largest_step_exceeds_set_aside", hint="lower gpu_memory_utilization", **fields)
        else:
            log.info("largest_step_measured", **fields)

    def _wants_cuda_graphs(self) -> bool:
        # Not with tensor parallelism yet: the graphs would have to capture the all-reduces too.
        # A pooling model never decodes: nothing to replay.
        return (self.device.type == "cuda" and not self.config.enforce_eager and self.tp.size == 1
                and self.pooler is None and getattr(self.attention, "supports_cuda_graphs", False))

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        """Decode graphs, checked against the eager pass; None (serve eagerly) when either fails."""
        from services.worker.cuda_graphs import CudaGraphCapturer, capture_decode_graphs, check_decode_graphs

        started = time.perf_counter()
        try:
            with torch.inference_mode():
                # A decode batch has a block of its own per sequence: no more sequences than blocks.
                graphs = capture_decode_graphs(self.model, self.attention, block_size=self.config.block_size,
                                               max_model_len=self.max_model_len,
                                               max_num_seqs=min(self.config.max_num_seqs, self.num_blocks),
                                               device=self.device, capturer=CudaGraphCapturer())
                error = check_decode_graphs(graphs, self.model, self.attention, num_blocks=self.num_blocks,
                                            vocab_size=self.model_config.vocab_size, dtype=self.dtype,
                                            device=self.device)
        except Exception as exc:  # a graph that cannot be trusted makes a slower worker, not a dead one
            log.warning("cuda_graphs_disabled", reason=repr(exc), fallback="eager", exc_info=True)
            self._synchronize()  # but a broken CUDA context (a fault in a replay) is fatal: this raises
            return None
        self.startup_seconds["cuda_graphs"] = time.perf_counter() - started
        log.info("cuda_graphs_captured", batch_sizes=graphs.sizes, context_classes=graphs.contexts,
                 max_row_error=round(error, 6), seconds=round(self.startup_seconds["cuda_graphs"], 2))
        return graphs

    def _resolve_max_model_len(self) -> int:
        model = self.model_config
        limit = model.max_position_embeddings
        if self.pooler is not None and self.pooler.config.max_seq_length is not None:
            limit = min(limit, self.pooler.config.max_seq_length)  # what sentence-transformers would truncate to
        wanted = self.config.max_model_len
        if wanted is not None and wanted > limit:
            raise ValueError(f"max_model_len={wanted} exceeds what the model at {self.model_dir} supports ({limit})")
        return wanted or limit

    @property
    def info(self) -> WorkerInfo:
        return WorkerInfo(model=str(self.model_dir), num_kv_blocks=self.num_blocks, block_size=self.config.block_size,
                          max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                          eos_token_ids=tuple(self.eos_token_ids), device=str(self.device),
                          dtype=str(self.dtype).removeprefix("torch."), num_cpu_blocks=self.num_host_blocks,
                          num_speculative_tokens=self.proposer.num_tokens if self.proposer is not None else 0,
                          tensor_parallel_rank=self.tp.rank, tensor_parallel_size=self.tp.size,
                          max_loras=self.config.max_loras if self.adapters is not None else 0,
                          max_lora_rank=self.config.max_lora_rank if self.adapters is not None else 0,
                          pooler=self.pooler.config if self.pooler is not None else None, kv_window=self.kv_window)

    def _kv_window(self) -> int | None:
        """The most keys any attention layer sees back, over the target and a draft model (which shares
        the block tables); None if a layer sees the whole context."""
        specs = [(self.model.attention_spec(), self.model_config.num_hidden_layers)]
        if isinstance(self.proposer, DraftModelProposer):
            draft = self.proposer.draft
            specs.append((draft.model.attention_spec(), draft.config.num_hidden_layers))
        return kv_window(*specs)

    # --- one step ---------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        for fork in plan.forks:  # before anything else: the child copies the parent as it was
            child = self.seqs[fork.parent_seq_id].fork(fork.child_seq_id, fork.child_index)
            self._keep(child)
        for seq_id in plan.finished_seq_ids:
            self._drop(seq_id)
        self._move_blocks(plan)
        batch = self._apply_plan(plan)
        failed = self._load_adapters(batch) if self.adapters is not None else []
        if failed:
            batch = [(seq, n) for seq, n in batch if not seq.failed]
        if not batch:
            return StepResult(step_id=plan.step_id, outputs=failed)
        self.step_timer.start()
        computed_before = [seq.num_computed_tokens for seq, _ in batch]
        with torch.inference_mode():
            hidden = self._forward(batch)
            self.step_timer.forward_done()
            outputs = self._sample(batch, hidden)
            for seq, num_tokens in batch:
                seq.finish_verification(num_tokens, self.config.block_size)
            self.step_timer.sampling_done()
            if self.proposer is not None:
                self._propose(batch, computed_before, outputs)
        forward_s, sample_s, propose_s = self.step_timer.finish()
        return StepResult(step_id=plan.step_id, outputs=[outputs[i] for i in sorted(outputs)] + failed,
                          forward_time_s=forward_s, sample_time_s=sample_s, propose_time_s=propose_s)

    def _load_adapters(self, batch: list[tuple[WorkerSequence, int]]) -> list[SequenceOutput]:
        """Puts the step's adapters in slots and tells the model which tokens use which. A sequence whose
        adapter cannot be loaded fails (an error output; its request ends) and leaves the batch."""
        slots, errors = self.adapters.slots_for([seq.lora for seq, _ in batch])
        failed = []
        for seq, _ in batch:
            if seq.lora in errors:
                seq.failed = True
                failed.append(SequenceOutput(seq_id=seq.seq_id, token_id=None, error=errors[seq.lora]))
                log.warning("lora_adapter_not_loaded", adapter=seq.lora.name, path=seq.lora.path,
                            reason=errors[seq.lora])
        kept = [(slot, n) for slot, (seq, n) in zip(slots, batch) if not seq.failed]
        self.adapters.batch.set_token_slots([slot for slot, _ in kept], [n for _, n in kept])
        return failed

    def _propose(self, batch: list[tuple[WorkerSequence, int]], computed_before: list[int],
                 outputs: dict[int, SequenceOutput]) -> None:
        """The next step's drafts of every sequence that sampled, into its output."""
        new_tokens = []
        for i in range(len(batch)):
            out = outputs.get(i)
            new_tokens.append([*out.accepted_token_ids, out.token_id] if out is not None and out.token_id is not None
                              else [])
        limit = self.config.speculative_config.disable_by_batch_size
        wanted = limit is None or len(batch) <= limit  # else no drafts (a draft model still follows what was kept)
        drafts = self.proposer.propose_batch([seq for seq, _ in batch], computed_before, new_tokens, self.block_tables,
                                             wanted)
        for i, proposed in enumerate(drafts):
            seq = batch[i][0]
            if proposed and not seq.constrained and not seq.sampling.bad_words:  # their states verify no drafts
                outputs[i].draft_token_ids = proposed

    def _move_blocks(self, plan: StepPlan) -> None:
        """Swap out, swap in, then copy-on-write copies: all before the forward pass, in every pool."""
        for device_pool, host_pool in self.pools:
            if plan.swap_out:
                self._swap_out(device_pool, host_pool, plan.swap_out)
            if plan.swap_in:
                self._swap_in(host_pool, device_pool, plan.swap_in)
            if plan.copies:
                self._copy_blocks(device_pool, plan.copies)

    def _copy_blocks(self, pool: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        overlapping = {src for src, _ in pairs} & {dst for _, dst in pairs}
        if self.device.type == "cuda" and not overlapping:  # the Triton kernel runs pairs in parallel
            from services.worker.attention.triton_cache_ops import copy_blocks

            copy_blocks(pool, pairs)
        else:
            copy_blocks_torch(pool, pairs)

    def _apply_plan(self, plan: StepPlan) -> list[tuple[WorkerSequence, int]]:
        batch = []
        for new in plan.new:
            if (new.pooling is not None) != (self.pooler is not None):
                raise ValueError(f"step {plan.step_id}: sequence {new.seq_id} is "
                                 f"{'an embedding' if new.pooling is not None else 'a generation'} request, but this "
                                 f"worker runs a {'pooling' if self.pooler is not None else 'generative'} model")
            if new.lora is not None and self.adapters is None:
                raise ValueError(f"step {plan.step_id}: sequence {new.seq_id} asks for LoRA adapter "
                                 f"{new.lora.name!r}, but this worker was started without LoRA")
            seq = WorkerSequence.from_new(new, self.vocab_size, self.block_tables,
                                          keep_history=getattr(self.proposer, "needs_history", False),
                                          grammars=self.grammars)
            self._keep(seq)  # a sequence preempted by recompute comes back as new
            batch.append((seq, new.num_scheduled_tokens))
        for delta in plan.running:
            seq = self.seqs.get(delta.seq_id)
            if seq is None:
                raise ValueError(f"step {plan.step_id}: sequence {delta.seq_id} is unknown to this worker")
            if seq.failed:
                continue  # planned before the scheduler heard that its request failed
            seq.apply(delta, plan.step_id)
            batch.append((seq, delta.num_scheduled_tokens))
        return batch

    def _keep(self, seq: WorkerSequence) -> None:
        self._drop(seq.seq_id)
        self.seqs[seq.seq_id] = seq

    def _drop(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            seq.release()

    def forget_all(self) -> None:
        """Drops every sequence (a new scheduler starts from nothing)."""
        for seq_id in list(self.seqs):
            self._drop(seq_id)

    def _forward(self, batch: list[tuple[WorkerSequence, int]]) -> torch.Tensor:
        scheduled = [ScheduledSequence(seq.token_ids, seq.block_table, seq.num_computed_tokens, n, seq.draft_token_ids)
                     for seq, n in batch]
        tables = self.block_tables.gather([seq.table_row for seq, _ in batch])
        # The graphs were captured without adapters: a step that runs one goes eagerly.
        uses_adapters = self.adapters is not None and self.adapters.batch.mask is not None
        if self.decode_graphs is not None and not uses_adapters and self.decode_graphs.can_replay(scheduled):
            self._query_start = list(range(len(batch) + 1))
            return self.decode_graphs.forward(scheduled, tables)
        inputs = build_model_inputs(scheduled, self.config.block_size, self.device, tables)
        self._query_start = inputs.meta.query_start_loc.tolist()
        return self.model(inputs.input_ids, inputs.positions, self.attention, inputs.meta)

    def _sample(self, batch: list[tuple[WorkerSequence, int]], hidden: torch.Tensor) -> dict[int, SequenceOutput]:
        """Logits only where needed: each finishing sequence's last token(s), and prompt rows asked for.
        The outputs by batch index."""
        rows: list[int] = []
        sampling: list[tuple[int, WorkerSequence]] = []  # (batch index, seq) that sample a token
        prompt_rows: list[tuple[int, WorkerSequence, int, int]] = []  # (batch index, seq, first row, count)
        if self.pooler is not None:
            return self._pool(batch, hidden)
        for i, (seq, num_tokens) in enumerate(batch):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_tokens
            if seq.params.prompt_logprobs is not None and start < seq.prompt_len - 1:
                count = min(end, seq.prompt_len - 1) - start
                prompt_rows.append((i, seq, len(rows), count))
                rows.extend(range(self._query_start[i], self._query_start[i] + count))
            if end == len(seq.token_ids) + len(seq.draft_token_ids):
                sampling.append((i, seq))
        sample_rows = [self._query_start[i + 1] - 1 for i, _ in sampling]
        involved = sorted({i for i, *_ in prompt_rows} | {i for i, _ in sampling})
        outputs = {i: SequenceOutput(seq_id=batch[i][0].seq_id, token_id=None) for i in involved}
        if prompt_rows:
            self._prompt_logprobs(hidden, rows, prompt_rows, outputs)
        if sampling:
            self._sample_tokens(hidden, sampling, sample_rows, outputs)
        return outputs

    def _pool(self, batch: list[tuple[WorkerSequence, int]], hidden: torch.Tensor) -> dict[int, SequenceOutput]:
        """Each sequence's states into its pooling; the embeddings of those whose prompt this step completes
        (brought to the host together: one transfer per step, not one per sequence)."""
        finished = []  # (batch index, sequence, pooled vector on the device)
        for i, (seq, num_tokens) in enumerate(batch):
            rows = hidden[self._query_start[i]:self._query_start[i + 1]]
            self.pooler.add_chunk(seq.pool_state, rows, seq.num_computed_tokens)
            if seq.num_computed_tokens + num_tokens == len(seq.token_ids):
                finished.append((i, seq, self.pooler.pooled(seq.pool_state, rows[-1])))
        if not finished:
            return {}
        vectors = torch.stack([vector for *_, vector in finished])
        if self.pooler.config.classifies:
            vectors = self.model.classify(vectors)  # the logits; the activation is each request's (finish)
        vectors = vectors.cpu()
        finite = torch.isfinite(vectors).all(dim=1).tolist()
        outputs = {}
        for (i, seq, _), vector, ok in zip(finished, vectors, finite):
            outputs[i] = SequenceOutput(seq_id=seq.seq_id, token_id=None,
                                        embedding=self.pooler.finish(vector, seq.pooling).tolist()) if ok else \
                SequenceOutput(seq_id=seq.seq_id, token_id=None, error=f"the pooled output of sequence {seq.seq_id} is not "
                               f"finite (an overflow in {str(self.dtype).removeprefix('torch.')}): try float32 or bfloat16")
        return outputs

    def _sample_tokens(self, hidden, sampling, sample_rows, outputs) -> None:
        """One token per sequence (one per position, for a sequence verifying drafts), plus one per
        waiting sibling from the same row (n > 1); then the drafts of the next step."""
        rows, states, owners = [], [], []
        for (_, seq), row in zip(sampling, sample_rows):
            drafts = seq.draft_token_ids
            if drafts:  # the last len(drafts) + 1 rows: after the sequence's last token, then after each draft
                rows.extend(range(row - len(drafts), row + 1))
                states.extend(seq.sampling.verification_states(drafts, self.sampler.device))
            else:
                rows.append(row)
                states.append(seq.sampling)
        num_own = len(rows)
        for (i, seq), row in zip(sampling, sample_rows):
            for state in seq.sibling_sampling:
                rows.append(row)
                states.append(state)
                owners.append(i)
            seq.sibling_sampling = []
        # max_num_seqs rows at a time: forked siblings can take a step past it, and the start-up's
        # largest step (largest_step.py) measured the sampler at that many rows.
        sampled = []
        chunk = self.config.max_num_seqs
        for first in range(0, len(rows), chunk):
            logits = self.model.compute_logits(hidden[rows[first:first + chunk]])
            sampled += self.sampler.sample(logits, states[first:first + chunk])
            del logits  # before the next chunk's
        taken = 0
        for i, seq in sampling:
            positions = sampled[taken:taken + len(seq.draft_token_ids) + 1]
            taken += len(positions)
            self._accept(seq, positions, outputs[i])
            if seq.constrained and seq.sampling.grammar.error is not None:  # its request ends, the step goes on
                outputs[i].error = seq.sampling.grammar.error
        for i, (token_id, logprobs) in zip(owners, sampled[num_own:]):
            outputs[i].siblings.append(Sample(token_id=token_id, logprobs=logprobs))

    @staticmethod
    def _accept(seq: WorkerSequence, positions: list, out: SequenceOutput) -> None:
        """Keep the drafts up to the first one the model's own sample at its position disagrees with,
        then that sample (or, all kept, the one after the last draft). Each position was sampled
        exactly as it would have been without drafts (same state, same seeded noise), so the
        output is what plain decoding gives: for greedy and seeded requests, token for token."""
        drafts = seq.draft_token_ids
        accepted = 0
        while accepted < len(drafts) and positions[accepted][0] == drafts[accepted]:
            accepted += 1
        out.token_id, out.logprobs = positions[accepted]
        if accepted:
            out.accepted_token_ids = drafts[:accepted]
            if out.logprobs is not None:
                out.accepted_logprobs = [logprobs for _, logprobs in positions[:accepted]]
        seq.num_rejected_drafts = len(drafts) - accepted
        # append_last_sample stands for one token: a plan made ahead must never follow accepted drafts.
        seq.last_sample = None if accepted else out.token_id

    def _prompt_logprobs(self, hidden, rows, prompt_rows, outputs) -> None:
        """Logits for max_num_seqs prompt rows at a time: a step's whole token budget of [rows, vocab]
        logits could take gigabytes that the start-up's largest step (largest_step.py) never set aside."""
        chunk = self.config.max_num_seqs
        for i, seq, first, count in prompt_rows:
            start = seq.num_computed_tokens
            targets = seq.token_ids[start + 1:start + 1 + count]
            positions = []
            for offset in range(0, count, chunk):
                logits = self.model.compute_logits(hidden[rows[first + offset:first + min(offset + chunk, count)]])
                positions += self.sampler.prompt_logprobs(logits, targets[offset:offset + chunk],
                                                          seq.params.prompt_logprobs)
                del logits  # before the next chunk's
            outputs[i].prompt_logprobs = positions
            outputs[i].prompt_logprobs_start = start + 1

    def _synchronize(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
