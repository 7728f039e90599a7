"""The worker: model weights, KV pools, attention and sampler; executes step plans exactly as told."""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate

import structlog
import torch

from services.worker.block_moves import copy_blocks_torch
from services.worker.cuda_startup import BuiltWorker, start_up_cuda
from services.worker.draft_model_proposer import DraftModelProposer
from services.worker.grammar import Grammars
from services.worker.host_block_tables import HostBlockTables
from services.worker.encoder_cache import encoder_cache_rows
from services.worker.image_features import ImageEncoder, image_key_limits, image_spans
from services.worker.input_batch import ScheduledSequence, build_model_inputs
from services.worker.kv_transfer import KVPuller
from services.worker.model_loader import load_eos_token_ids
from services.worker.mrope import MRopePositions
from services.worker.output_rows import PromptRows, StepHidden, rows_read
from services.worker.sampler import Sampler
from services.worker.step_timer import StepTimer
from services.worker.worker_sequence import WorkerSequence
from services.worker.worker_startup import (KVCache, ModelSource, Weights, allocate_kv_cache, block_swaps,
                                            build_attention, join_tensor_parallel, load_weights, make_proposer,
                                            place_on_device, read_model, worker_kv_window)
from shared.config import EngineConfig
from shared.step_protocol import Sample, SequenceOutput, StepPlan, StepResult, WorkerInfo

log = structlog.get_logger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, tensor_parallel_rank: int = 0, distributed_init_method: str | None = None):
        """With config.tensor_parallel_size > 1, this is one rank of the workers that hold the model
        between them; they meet at ``distributed_init_method`` (tcp://host:port) before loading.
        The start-up steps (worker_startup.py) each take what the earlier ones built."""
        self.config = config
        source = read_model(config)
        self.device = place_on_device(config.device)
        self.tp = join_tensor_parallel(config, source, tensor_parallel_rank, distributed_init_method, self.device)
        weights = load_weights(config, source, self.tp, self.device)
        kv = allocate_kv_cache(config, source, weights, self.device)
        backend, self.attention = build_attention(config, kv, weights.model, self.device)
        self.eos_token_ids = load_eos_token_ids(source.model_dir)
        self.sampler = Sampler(weights.model_config.vocab_size, self.eos_token_ids, seed=config.seed,
                               device=self.device)
        # Structured outputs: built on first use (the tokenizer, and xgrammar's compiler over it).
        self.grammars = Grammars(config.tokenizer or source.model_dir, weights.model_config.vocab_size,
                                 self.eos_token_ids)
        self.proposer = make_proposer(config, source, weights, kv, backend, self.device)
        self._keep_parts(source, weights, kv)
        startup = start_up_cuda(BuiltWorker(config, source, weights, kv, self.attention,
                                            self.sampler if source.pooler is None else None, self.proposer, self.tp,
                                            self.device))
        self.startup_seconds, self.startup_memory = startup.seconds, startup.memory
        self.decode_graphs = startup.decode_graphs
        # Serving state: the sequences the plans sent, their block tables, the steps' timings.
        self.seqs: dict[int, WorkerSequence] = {}
        self.block_tables = HostBlockTables(width=-(-self.max_model_len // config.block_size))
        self.step_timer = StepTimer(self.device)
        self.kv_puller = KVPuller()  # prefill/decode disaggregation: blocks read from prefill workers
        # A vision-language model's images: encoded as their placeholders are computed, kept by their hash.
        self.image_encoder = ImageEncoder(weights.vision, encoder_cache_rows(config, source.max_model_len)) \
            if weights.vision is not None else None
        self.image_token_id = weights.image_token_id if weights.vision is not None else None
        self._refused: list[SequenceOutput] = []  # this step's sequences whose images the encoder refused
        # Gemma 3: an image's placeholders attend to each other both ways (the scheduler never cuts one).
        self._whole_images = weights.vision is not None and weights.vision.attends_both_ways
        # Qwen2-VL: the rotary positions of image placeholders and the text after them (mrope.py).
        self.mrope = MRopePositions(weights.vision.spatial_merge_size) \
            if weights.vision is not None and weights.model_config.mrope_section is not None else None

    def _keep_parts(self, source: ModelSource, weights: Weights, kv: KVCache) -> None:
        """What the steps read of the start-up's results, under the names they use."""
        self.model_dir, self.pooler, self.dtype, self.max_model_len = (source.model_dir, source.pooler, source.dtype,
                                                                       source.max_model_len)
        # model_config is this rank's share (its heads, KV pools and MLP columns), not the whole model's.
        self.model, self.model_config, self.adapters = weights.model, weights.model_config, weights.adapters
        self.vocab_size = weights.model_config.vocab_size
        self.num_blocks, self.kv_pools, self.kv_pool = kv.num_blocks, kv.kv_pools, kv.kv_pool
        self.num_host_blocks, self.host_pool = kv.num_host_blocks, kv.host_pool
        self.num_offload_blocks = kv.num_offload_blocks  # of the host blocks, the prefix cache's tier
        self._swap_out, self._swap_in = block_swaps(self.device)
        # (device pool, host pool) pairs that every block move applies to: the target's, and a draft model's.
        self.pools = [(self.kv_pool, self.host_pool)]
        if isinstance(self.proposer, DraftModelProposer):
            self.pools.append((self.proposer.kv_pool, self.proposer.host_pool))
        self.device_pools = [device_pool for device_pool, _ in self.pools]  # what ReadBlocks and pulls move
        self.kv_window = worker_kv_window(weights, self.proposer)  # reported: the scheduler frees blocks behind it

    @property
    def info(self) -> WorkerInfo:
        return WorkerInfo(model=str(self.model_dir), num_kv_blocks=self.num_blocks, block_size=self.config.block_size,
                          max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                          eos_token_ids=tuple(self.eos_token_ids), device=str(self.device),
                          dtype=str(self.dtype).removeprefix("torch."), num_cpu_blocks=self.num_host_blocks,
                          num_cpu_offload_blocks=self.num_offload_blocks,
                          num_speculative_tokens=self.proposer.num_tokens if self.proposer is not None else 0,
                          tensor_parallel_rank=self.tp.rank, tensor_parallel_size=self.tp.size,
                          max_loras=self.config.max_loras if self.adapters is not None else 0,
                          max_lora_rank=self.config.max_lora_rank if self.adapters is not None else 0,
                          pooler=self.pooler.config if self.pooler is not None else None, kv_window=self.kv_window,
                          image_token_id=self.image_token_id, whole_images=self._whole_images,
                          kv_cache_dtype=str(self.kv_pool.dtype).removeprefix("torch."),
                          kv_scales_measured=bool(self.config.calculate_kv_scales)
                          and self.kv_pool.dtype in (torch.float8_e4m3fn, torch.float8_e5m2))

    # --- one step ---------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        for fork in plan.forks:  # before anything else: the child copies the parent as it was
            child = self.seqs[fork.parent_seq_id].fork(fork.child_seq_id, fork.child_index)
            self._keep(child)
        for seq_id in plan.finished_seq_ids:
            self._drop(seq_id)
        unfilled = self._move_blocks(plan)
        self._refused = []
        batch = self._apply_plan(plan)
        # Sequences whose tables name a block a swap-in left unfilled: their KV is not there, the scheduler
        # recomputes them.
        left_out = [seq.seq_id for seq, _ in batch if not unfilled.isdisjoint(seq.block_table)] if unfilled else []
        if left_out:
            batch = [(seq, n) for seq, n in batch if seq.seq_id not in left_out]
        failed = self._refused + (self._load_adapters(batch) if self.adapters is not None else [])
        if failed:
            batch = [(seq, n) for seq, n in batch if not seq.failed]
        if not batch:
            return StepResult(step_id=plan.step_id, outputs=failed, failed_block_ids=sorted(unfilled),
                              recompute_seq_ids=left_out)
        self.step_timer.start()
        computed_before = [seq.num_computed_tokens for seq, _ in batch]
        query_start = list(accumulate((n for _, n in batch), initial=0))
        prompt_rows, sampling = self._outputs_wanted(batch, query_start)
        with torch.inference_mode():
            hidden = self._forward(batch, self._rows_to_compute(query_start, prompt_rows, sampling))
            self.step_timer.forward_done()
            outputs = self._sample(batch, hidden, query_start, prompt_rows, sampling)
            for seq, num_tokens in batch:
                seq.finish_verification(num_tokens, self.config.block_size)
            self.step_timer.sampling_done()
            if self.proposer is not None:
                self._propose(batch, computed_before, outputs)
        forward_s, sample_s, propose_s = self.step_timer.finish()
        return StepResult(step_id=plan.step_id, outputs=[outputs[i] for i in sorted(outputs)] + failed,
                          forward_time_s=forward_s, sample_time_s=sample_s, propose_time_s=propose_s,
                          failed_block_ids=sorted(unfilled), recompute_seq_ids=left_out)

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

    def _move_blocks(self, plan: StepPlan) -> set[int]:
        """Swap out, swap in, pulls from prefill workers, then copy-on-write copies: all before the forward pass,
        in every pool. Returns the device blocks a failed swap-in or pull left unfilled (a transfer that failed
        costs a recompute, not the worker): for a swap-in any of the plan's, since one failure may leave any of
        them half written; for a pull, that pull's."""
        unfilled: set[int] = set()
        for device_pool, host_pool in self.pools:
            if plan.swap_out:
                self._swap_out(device_pool, host_pool, plan.swap_out)
            if plan.swap_in and not unfilled:
                try:
                    self._swap_in(host_pool, device_pool, plan.swap_in)
                except (RuntimeError, OSError, MemoryError) as error:
                    log.error("swap_in_failed", blocks=len(plan.swap_in), error=str(error))
                    unfilled = {dst for _, dst in plan.swap_in}
        if plan.swap_in and self.tp.size > 1:  # every rank must leave the same sequences out of the step
            failures = self.tp.all_reduce(torch.tensor([float(bool(unfilled))], device=self.device))
            unfilled = {dst for _, dst in plan.swap_in} if failures.item() else set()
        if plan.pulls:
            unfilled |= self.kv_puller.pull(plan, self.device_pools)
        if plan.copies:
            for device_pool in self.device_pools:
                self._copy_blocks(device_pool, plan.copies)
        return unfilled | {dst for src, dst in plan.copies if src in unfilled}

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
            if new.images and self._refuse_images(seq):
                continue
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

    def _refuse_images(self, seq: WorkerSequence) -> bool:
        """Fails a new sequence whose images this model's encoder cannot take as they are (made by hand, or for
        another model): an error output, its request ends."""
        try:
            if self.image_encoder is None:
                raise ValueError("this worker's model takes no images")
            for image in seq.images:
                self.image_encoder.vision.check(image)
        except ValueError as error:
            seq.failed = True
            self._refused.append(SequenceOutput(seq_id=seq.seq_id, token_id=None, error=f"images: {error}"))
            log.warning("images_refused", seq_id=seq.seq_id, reason=str(error))
            return True
        return False

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
        self.kv_puller.forget()

    def _rows_to_compute(self, query_start: list[int], prompt_rows: list[PromptRows],
                         sampling: list[tuple[int, WorkerSequence]]) -> list[int] | None:
        """The step rows whose final hidden states the outputs read (output_rows.py), or None for every row: where
        that is all of them (decodes), and for a pooling model (it pools every row)."""
        if self.pooler is not None:
            return None
        rows = rows_read(query_start, prompt_rows, sampling)
        # (a step of prompt chunks alone still computes one row: no kernel meets an empty input)
        return None if len(rows) == query_start[-1] else rows or [query_start[-1] - 1]

    def _forward(self, batch: list[tuple[WorkerSequence, int]], rows: list[int] | None) -> StepHidden:
        """The final hidden states of step rows ``rows`` (None: of every scheduled token); others may come too."""
        scheduled = [ScheduledSequence(seq.token_ids, seq.block_table, seq.num_computed_tokens, n, seq.draft_token_ids,
                                       self._rope_offset(seq)) for seq, n in batch]
        tables = self.block_tables.gather([seq.table_row for seq, _ in batch])
        spans = image_spans(batch) if self.image_encoder is not None else []  # (images: their features go in)
        if self.decode_graphs is not None and not spans and self.decode_graphs.can_replay(scheduled):
            return StepHidden(self.decode_graphs.forward(scheduled, tables), None)
        inputs = build_model_inputs(scheduled, self.config.block_size, self.device, tables)
        output_rows = None if rows is None else torch.tensor(rows, dtype=torch.int64).to(self.device)
        if output_rows is not None and self.adapters is not None:
            self.adapters.batch.keep_output_rows(output_rows)
        if spans:  # (the image's features go in as embeddings: every model's forward takes them)
            if self.mrope is not None:
                inputs.positions = self.mrope.step_positions(batch).to(self.device)
            if self._whole_images:
                inputs.meta = replace(inputs.meta, key_limits=image_key_limits(inputs.positions, spans, self.device))
            embeds = self.model.embed(inputs.input_ids)
            self.image_encoder.fill(embeds, spans)
            hidden = self.model(inputs.input_ids, inputs.positions, self.attention, inputs.meta, inputs_embeds=embeds,
                                output_rows=output_rows)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.attention, inputs.meta,
                                output_rows=output_rows)
        return StepHidden(hidden, rows)

    def _rope_offset(self, seq: WorkerSequence) -> int:
        """M-RoPE's shift of the sequence's text tokens from here on (0 for other models)."""
        return self.mrope.shift(seq.images, seq.num_computed_tokens) if self.mrope is not None and seq.images else 0

    def _outputs_wanted(self, batch: list[tuple[WorkerSequence, int]], query_start: list[int]
                        ) -> tuple[list[PromptRows], list[tuple[int, WorkerSequence]]]:
        """Where logits are needed: the rows of prompt logprobs asked for, and the ``(batch index, sequence)`` of
        each sequence that samples a token (its last scheduled token is its last, drafts aside). Neither for
        a pooling model."""
        prompt_rows: list[PromptRows] = []
        sampling: list[tuple[int, WorkerSequence]] = []
        if self.pooler is not None:
            return prompt_rows, sampling
        for i, (seq, num_tokens) in enumerate(batch):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_tokens
            if seq.params.prompt_logprobs is not None and start < seq.prompt_len - 1:
                prompt_rows.append((i, seq, query_start[i], min(end, seq.prompt_len - 1) - start))
            if end == len(seq.token_ids) + len(seq.draft_token_ids):
                sampling.append((i, seq))
        return prompt_rows, sampling

    def _sample(self, batch: list[tuple[WorkerSequence, int]], hidden: StepHidden, query_start: list[int],
                prompt_rows: list[PromptRows], sampling: list[tuple[int, WorkerSequence]]) -> dict[int, SequenceOutput]:
        """Logits only where needed (_outputs_wanted); a pooling model's embeddings. The outputs by batch index."""
        if self.pooler is not None:
            return self._pool(batch, hidden.states, query_start)
        sample_rows = [query_start[i + 1] - 1 for i, _ in sampling]
        involved = sorted({i for i, *_ in prompt_rows} | {i for i, _ in sampling})
        outputs = {i: SequenceOutput(seq_id=batch[i][0].seq_id, token_id=None) for i in involved}
        if prompt_rows:
            self._prompt_logprobs(hidden, prompt_rows, outputs)
        if sampling:
            self._sample_tokens(hidden, sampling, sample_rows, outputs)
        return outputs

    def _pool(self, batch: list[tuple[WorkerSequence, int]], hidden: torch.Tensor,
              query_start: list[int]) -> dict[int, SequenceOutput]:
        """Each sequence's states into its pooling; the embeddings of those whose prompt this step completes
        (brought to the host together: one transfer per step, not one per sequence)."""
        finished = []  # (batch index, sequence, pooled vector on the device)
        for i, (seq, num_tokens) in enumerate(batch):
            rows = hidden[query_start[i]:query_start[i + 1]]
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
            logits = self.model.compute_logits(hidden.take(rows[first:first + chunk]))
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

    def _prompt_logprobs(self, hidden: StepHidden, prompt_rows: list[PromptRows], outputs) -> None:
        """Logits for max_num_seqs prompt rows at a time: a step's whole token budget of [rows, vocab]
        logits could take gigabytes that the start-up's largest step (largest_step.py) never set aside."""
        chunk = self.config.max_num_seqs
        for i, seq, first, count in prompt_rows:
            start = seq.num_computed_tokens
            targets = seq.token_ids[start + 1:start + 1 + count]
            positions = []
            for offset in range(0, count, chunk):
                logits = self.model.compute_logits(hidden.take(list(range(first + offset,
                                                                          first + min(offset + chunk, count)))))
                positions += self.sampler.prompt_logprobs(logits, targets[offset:offset + chunk],
                                                          seq.params.prompt_logprobs)
                del logits  # before the next chunk's
            outputs[i].prompt_logprobs = positions
            outputs[i].prompt_logprobs_start = start + 1
