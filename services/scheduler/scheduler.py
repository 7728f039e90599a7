"""The step scheduler: which sequences run this step, how many tokens each, and which blocks they use.

It plans and allocates; applying a step's result (tokens, stop checks, drafts, beams, embeddings)
is output_processor.py's, which ends and forks sequences through finish() and fork() here.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque
from dataclasses import dataclass

from services.scheduler.block_manager import NO_HIT, BlockManager, CacheHit
from services.scheduler.draft_acceptance import DraftAcceptance
from services.scheduler.output_processor import OutputProcessor
from services.scheduler.preemption import choose_preemption
from services.scheduler.request_stats import RequestStats
from services.scheduler.sequence import Sequence, SequenceStatus, SequenceUpdate
from shared.step_protocol import Fork, KVPull, NewSequence, StepPlan, StepResult, running_sequence


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int  # sequences running at once (forked siblings may exceed it briefly)
    max_num_batched_tokens: int  # tokens computed per step (the token budget)
    enable_chunked_prefill: bool  # a prompt may be split over several steps
    preemption_mode: str | None = None  # "swap", "recompute", or None: automatic (see preemption.py)
    scheduling_policy: str = "fcfs"  # or "priority": requests' priority first (validate refuses it under fcfs)


def _in_order(seq: Sequence) -> tuple[int, int, int]:
    """Who goes first: the lower priority value (0 for every request under fcfs), then the earlier arrival."""
    return seq.request.priority, seq.arrival, seq.index


class Scheduler:
    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager, eos_token_ids: tuple[int, ...],
                 max_model_len: int, new_seq_id=None, max_loras: int = 0, hands_off: bool = False,
                 request_stats: RequestStats | None = None, whole_images: bool = False):
        """``max_loras``: the distinct LoRA adapters the worker runs in one step (0: none); ``new_seq_id``
        allocates ids for beams that fork. ``hands_off``: a prefill stage (prefill/decode disaggregation), whose
        sequences leave it once their prompt is computed and their first token sampled (take_handoffs);
        ``request_stats``: the per-request times, shared by the stages a request passes through;
        ``whole_images``: each image's placeholders attend to each other both ways (Gemma 3), so a step computes an
        image whole: no prefill chunk ends inside one."""
        self.limits = limits
        self.whole_images = whole_images
        self.hands_off = hands_off
        self._handed_off: list[Sequence] = []  # since the last take_handoffs
        self.max_loras = max_loras
        self.blocks = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in _in_order: the last is the preemption victim
        self.swapped: list[Sequence] = []  # in _in_order: the first resumes first
        self._step_id = 0
        self._plan = StepPlan(step_id=1)  # the next plan: drops and forks collect in it between steps
        self._unconfirmed_swap_in = False  # the last plan swaps blocks in: its result must come before the next plan
        self.num_preemptions = 0
        self.num_preemptions_swap = 0
        self.num_preemptions_recompute = 0
        self.num_swaps_out = 0  # sequences moved to host memory
        self.num_swaps_in = 0  # sequences moved back
        self.num_failed_swap_ins = 0  # steps whose swap-ins failed on the worker (their sequences recomputed)
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens found on the device (their prefill skipped)
        self.host_cache_queries = 0  # prompt tokens looked up in the host tier: those the device lacked
        self.host_cache_hits = 0  # of those, tokens found there (loaded, not computed)
        self.request_stats = RequestStats(max_model_len) if request_stats is None else request_stats
        self.num_kv_pulls = 0  # handed-off sequences whose KV came from a prefill worker
        self.kv_pull_blocks = 0  # blocks pulled for them
        self.kv_pull_blocks_cached = 0  # blocks this stage's prefix cache held, so not pulled
        self._pulls: dict[str, list[tuple[int, int]]] = {}  # this plan's pulls, by source
        self._encoder_budget = limits.max_num_batched_tokens  # left in the step being planned
        self.draft_acceptance = DraftAcceptance()  # speculative decoding's counts
        self._outputs = OutputProcessor(self, eos_token_ids, max_model_len, self.draft_acceptance, new_seq_id)

    # --- requests in and out ----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.request_stats.queued(seq)
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence, ahead: bool = False) -> None:
        """Into the waiting queue, kept in priority order (all 0 under fcfs: plain queue order): behind every
        sequence of its priority or better, or (``ahead``: a recompute victim, a beam's own work) in front of
        every sequence of its priority or worse."""
        priority = seq.request.priority
        if ahead:
            place = next((i for i, other in enumerate(self.waiting) if other.request.priority >= priority),
                         len(self.waiting))
        else:
            behind = next((i for i, other in enumerate(reversed(self.waiting)) if other.request.priority <= priority),
                          len(self.waiting))
            place = len(self.waiting) - behind
        self.waiting.insert(place, seq)

    def abort(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if not seq.status.is_finished:
                self.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # --- one step ---------------------------------------------------------------------------------

    def schedule(self) -> tuple[StepPlan, dict[int, int]]:
        """Plan one step; returns the plan and the tokens scheduled per seq id.

        Scheduling rule. Order is a request's priority (lower first, as vLLM's; every request's is 0 under
        --scheduling-policy fcfs), then arrival: "oldest" and "newest" below mean first and last in it.
        1. Running sequences first, oldest arrival first. Each gets the tokens it has not computed
           (one for a decode; the rest of its prompt for a prefill), cut to the token budget left.
           A sequence about to write into a block it shares (a fork's partly filled last block)
           gets a copy first. When blocks run short, the most recently arrived running sequence
           is preempted — swapped to host memory or dropped for recompute, by the rule in
           preemption.py — until they suffice, which may preempt the sequence itself. (Beams
           parked on their siblings' candidates go first: they only hold blocks.)
        2. Then, only if nobody was preempted this step, swapped sequences come back, oldest
           first, while blocks and budget allow. (So no step both swaps out and swaps in, and
           no block is moved both ways in one step.) A sequence whose LoRA adapter would make the
           running sequences' distinct adapters more than max_loras is passed over, here and in 4.
        3. Then, only without preemption and once nothing is left swapped, speculative decoding's drafts:
           a sequence scheduled to sample, whose worker proposed drafts, may compute them after its
           token, oldest first, within max_tokens, the context, the budget left and the free blocks
           (less the watermark). Drafts are optional: they never preempt anything, and never displace
           a running or swapped sequence's tokens (they may displace waiting work, as in vLLM).
        4. Then, under the same conditions, waiting sequences in queue order (a recompute
           victim sits at its head) while the budget, max_num_seqs and free blocks (less a small
           watermark, kept while anything runs) allow; a prompt starts after its cached prefix. With chunked prefill a
           prompt may take part of the budget left; without, it must fit whole. Images count too: the rows of
           features of the images whose placeholders a step starts share one encoder budget, as many as the
           token budget, and a chunk stops before an image it cannot afford (the step's first always fits).
        5. If nothing at all could be scheduled while sequences wait, the newest beam parked on
           its siblings' candidates is preempted: the blocks of beams that already reported are
           what the waiting siblings need (else beam groups could hold each other's blocks forever).
        The oldest running sequence is never a victim while another runs, so it always advances:
        no deadlock, and no livelock (requests that could never fit are refused at admission).
        (Blocks behind every layer's sliding window are freed when results come in, in update().)
        With a host tier (--kv-offloading-size), any block allocation may evict a cached prefix block into
        it (a store, run with the swap-outs), and a prompt's cached start may come from it (a load, run with
        the swap-ins): these moves go into every step's plan, whatever else it swaps.
        With prefill/decode disaggregation (disaggregated_core.py), a prefill stage (hands_off) schedules a
        sequence only up to its first sample, after which the sequence leaves it; on a decode stage such a
        sequence waits in the queue like any other, and its admission in rule 4 pulls the KV the prefill
        worker computed (the plan's pulls) into fresh blocks rather than computing it, after the start its
        own prefix cache holds. No plan is made ahead of a step that pulls, as of one that swaps in.

        The plan may be made while the previous step still runs (see can_plan_ahead): a sequence
        sampling in that step counts its coming token as a placeholder, computed in this step,
        and one whose last token is coming is left out. Such a plan never preempts.
        """
        self._step_id += 1
        plan, self._plan = self._plan, StepPlan(step_id=self._step_id + 1)
        budget = self.limits.max_num_batched_tokens
        self._encoder_budget = budget  # rows of image features this step may encode (_within_encoder_budget)
        scheduled: dict[int, int] = {}
        preempted = False
        for seq in list(self.running):
            if budget <= 0:
                break
            work = self._work_left(seq)
            if not work:
                continue  # preempted just now, a beam waiting for its siblings, or its last token is coming
            num_tokens = self._within_encoder_budget(seq, seq.num_planned_tokens, min(work, budget))
            if not num_tokens:
                continue  # its next tokens are an image the step has no encoder budget left for
            planned = seq.num_planned_tokens  # preempting others leaves it; preempting this one ends the loop
            allocation = None
            while seq.status is SequenceStatus.RUNNING:
                allocation = self.blocks.append_slots(seq.seq_id, planned + num_tokens, write_from=planned)
                if allocation is not None:
                    break
                self._preempt(self._victim(), plan)
                preempted = True
            if allocation is None:
                continue  # the sequence preempted itself
            if allocation.copy is not None:
                plan.copies.append(allocation.copy)
                seq.table_replaced = True
            scheduled[seq.seq_id] = num_tokens
            budget -= num_tokens
        if not preempted:
            budget = self._swap_in(budget, scheduled, plan)
            if not any(seq.num_uncomputed_tokens for seq in self.swapped):
                # Swapped sequences come first: drafts and new work wait until they are back.
                budget = self._grant_drafts(budget, scheduled)
                budget = self._admit_waiting(budget, scheduled)
            if not scheduled and not plan.swap_in and (self.swapped or self.waiting):
                self._unpark_one(plan)
        stores, loads = self.blocks.seal_plan()
        plan.swap_out.extend(stores)
        plan.swap_in.extend(loads)
        plan.pulls, self._pulls = [KVPull(source, moves) for source, moves in self._pulls.items()], {}
        self._unconfirmed_swap_in = bool(plan.swap_in or plan.pulls)
        self._describe_work(scheduled, plan)
        return plan, scheduled

    def _grant_drafts(self, budget: int, scheduled: dict[int, int]) -> int:
        """Rule 3: drafts for scheduled sequences from what is left; the budget after them."""
        blocks = self.blocks
        for seq in self.running:
            if budget <= 0:
                break
            num_tokens = scheduled.get(seq.seq_id)
            if num_tokens is None or not self._may_draft(seq, num_tokens):
                continue
            through = seq.num_planned_tokens + num_tokens  # its slots reach here already
            room = min(budget, seq.max_output_tokens - len(seq.output_token_ids) - 1,
                       self.max_model_len - seq.num_tokens - 1,
                       blocks.free_slots_after(seq.seq_id, through, reserve_blocks=blocks.watermark_blocks))
            drafts = seq.draft_token_ids[:max(0, room)]
            if drafts:
                allocation = blocks.append_slots(seq.seq_id, through + len(drafts))
                assert allocation is not None, "free_slots_after promised room for the drafts"
                seq.inflight_drafts = drafts
                budget -= len(drafts)
        return budget

    @staticmethod
    def _may_draft(seq: Sequence, num_tokens: int) -> bool:
        """Whether the worker's drafts may follow this step's tokens: the step brings the sequence to
        sampling, and nothing else depends on that sample (beam search, siblings to fork from it)."""
        return bool(seq.draft_token_ids) and seq.beam_group is None and not seq.pending_siblings \
            and not seq.num_placeholders and seq.known_to_worker and num_tokens == seq.num_uncomputed_tokens

    def _work_left(self, seq: Sequence) -> int:
        """Tokens the running sequence could compute in this step; 0 when it has none to schedule."""
        if seq.status is not SequenceStatus.RUNNING or self.hands_off and seq.num_placeholders:
            return 0  # (a prefill stage's sequence whose first sample is coming is handed off, not decoded)
        work = seq.num_uncomputed_tokens
        return work if work > 0 and not seq.awaits_last_token(self.max_model_len) else 0

    def can_plan_ahead(self) -> bool:
        """Whether the next plan may be made now, while a step runs, rather than after its result.

        Not while a running sequence needs that result to be planned (beam search chooses tokens
        from it; n > 1 siblings fork from their parent's first sample; drafts in verification add
        an unknown number of tokens), and not when the running
        sequences' next tokens might not fit in the free blocks: preemption happens only with no
        step in flight, so a preempted sequence never has a token on the way.
        """
        if any(seq.beam_group is not None or seq.pending_siblings or seq.inflight_drafts for seq in self.running):
            return False
        if self._unconfirmed_swap_in:
            return False  # the step in flight swaps blocks in: if that fails, its sequences start again
        budget, needed = self.limits.max_num_batched_tokens, 0
        # Each sequence needs at most ceil(its tokens / block_size) + 1 new blocks, plus one
        # copy: when even the whole budget spread that way fits, the exact count is not needed.
        if self.blocks.blocks_for(budget) + 3 * len(self.running) <= self.blocks.num_free_blocks:
            return True
        for seq in self.running:
            if budget <= 0:
                break
            work = self._work_left(seq)
            if not work:
                continue
            num_tokens = min(work, budget)
            budget -= num_tokens
            needed += self.blocks.num_blocks_to_grow(seq.seq_id, seq.num_planned_tokens + num_tokens,
                                                     write_from=seq.num_planned_tokens)
        return needed <= self.blocks.num_free_blocks

    def cancel_empty(self, plan: StepPlan) -> None:
        """Take back a plan with nothing to compute, made while a step runs: its drops (the only
        side effect such a plan can have) go into the next one."""
        assert plan.is_empty and not (plan.forks or plan.swap_out or plan.swap_in or plan.copies), plan
        self._plan.finished_seq_ids[:0] = plan.finished_seq_ids
        self._plan.step_id, self._step_id = plan.step_id, self._step_id - 1

    def _swap_in(self, budget: int, scheduled: dict[int, int], plan: StepPlan) -> int:
        adapters = self._running_adapters()
        for seq in list(self.swapped):
            if budget <= 0:
                break
            if seq.num_uncomputed_tokens == 0:
                continue  # a parked beam: nothing to compute until its group decides
            if not self._adapter_fits(seq, adapters):
                continue
            num_tokens = self._within_encoder_budget(seq, seq.num_planned_tokens,
                                                     min(seq.num_uncomputed_tokens, budget))
            if not num_tokens:
                break  # its next tokens are an image this step cannot take (encoder budget, or a whole image)
            if not self.blocks.can_swap_in(seq.seq_id, seq.num_planned_tokens + num_tokens):
                break
            plan.swap_in.extend(self.blocks.swap_in(seq.seq_id))
            self.blocks.append_slots(seq.seq_id, seq.num_planned_tokens + num_tokens)
            self.swapped.remove(seq)
            seq.status, seq.table_replaced = SequenceStatus.RUNNING, True
            bisect.insort(self.running, seq, key=_in_order)
            if seq.request.lora is not None:
                adapters.add(seq.request.lora)
            self.num_swaps_in += 1
            scheduled[seq.seq_id] = num_tokens
            budget -= num_tokens
        return budget

    def _admit_waiting(self, budget: int, scheduled: dict[int, int]) -> int:
        adapters = self._running_adapters()
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.limits.max_num_seqs:
                break
            if seq.beam_group is not None and seq.beam_group.has_reported(seq.seq_id):
                continue  # a recomputed beam that already reported: nothing to do until its group decides
            if not self._adapter_fits(seq, adapters):
                continue  # waits for a running adapter to finish; others behind it may go
            hits, source = self._cache_hits(seq), seq.kv_source
            if source is not None:  # handed off by a prefill stage: its computed tokens come from there
                hits = self.blocks.transfer_hits(hits, source.block_ids)
            num_cached = hits.num_blocks * self.blocks.block_size if source is None else source.num_tokens
            num_tokens = seq.num_tokens - num_cached
            if num_tokens > budget and not self.limits.enable_chunked_prefill:
                break
            wanted = min(num_tokens, budget)
            num_tokens = self._within_encoder_budget(seq, num_cached, wanted)
            if not num_tokens or num_tokens < wanted and not self.limits.enable_chunked_prefill:
                break  # its images must wait for a step with encoder budget left
            total = num_cached + num_tokens
            # The watermark keeps room for running sequences to grow; with none, it protects nobody
            # (and a prompt needing nearly the whole cache, admissible as it is, would wait forever).
            if not self.blocks.can_allocate(seq.seq_id, total, keep_watermark=bool(self.running), hits=hits):
                break
            if source is None:
                self.blocks.allocate_with_hits(seq.seq_id, hits, total)
                num_loaded = len(hits.on_host) * self.blocks.block_size  # of the cached tokens, from the host tier
                self._count_cache_lookup(seq, num_cached, num_loaded)
            else:
                self._pull(seq, hits, total)
            seq.num_computed_tokens = num_cached
            if seq.num_cached_tokens is None:  # a recomputed sequence's own earlier blocks are no cache hit
                seq.num_cached_tokens = num_cached
                if self.request_stats.is_first_prefill(seq):
                    self.request_stats.first_admitted(seq, num_cached, num_loaded)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_in_order)
            if seq.request.lora is not None:
                adapters.add(seq.request.lora)
            scheduled[seq.seq_id] = num_tokens
            budget -= num_tokens
        return budget

    def _within_encoder_budget(self, seq: Sequence, start: int, num_tokens: int) -> int:
        """Of ``num_tokens`` from position ``start``, how many this step may compute so that the images whose
        placeholders start among them fit the step's encoder budget (rows of features the worker encodes, as
        many as the token budget): the chunk stops before the first image that does not fit. The step's first
        image always fits, however large, so that no image waits forever. Images that must be computed whole
        are not cut (_not_cutting_images)."""
        if self.whole_images:
            num_tokens = self._not_cutting_images(seq, start, num_tokens)
        for image in seq.request.images:
            if not start <= image.offset < start + num_tokens:
                continue
            if image.length > self._encoder_budget and self._encoder_budget < self.limits.max_num_batched_tokens:
                return image.offset - start
            self._encoder_budget -= image.length
        return num_tokens

    @staticmethod
    def _not_cutting_images(seq: Sequence, start: int, num_tokens: int) -> int:
        """Of ``num_tokens`` from ``start``, how many end the chunk outside every image: before an image it would
        cut, or none when it starts inside one (a prefix-cache hit may end there) and cannot reach its end. (An
        image never outgrows the step's budget: admission refuses it, RequestLimits.max_image_tokens.)"""
        end = start + num_tokens
        for image in seq.request.images:
            if image.offset < end < image.end:
                return max(image.offset - start, 0)
        return num_tokens

    def _pull(self, seq: Sequence, hits: CacheHit, num_tokens: int) -> None:
        """A handed-off sequence's table: what this stage caches of it, then blocks its KV is pulled into."""
        source = seq.kv_source
        moves = self.blocks.allocate_transferred(seq.seq_id, hits, source.block_ids, source.num_tokens, num_tokens)
        self._pulls.setdefault(source.address, []).extend(moves)
        self.num_kv_pulls += 1
        self.kv_pull_blocks += len(moves)
        self.kv_pull_blocks_cached += len(hits.device_blocks())

    def _running_adapters(self) -> set:
        """The LoRA adapters of the running sequences (empty without LoRA: nothing to count)."""
        return {seq.request.lora for seq in self.running if seq.request.lora is not None} if self.max_loras else set()

    def _adapter_fits(self, seq: Sequence, adapters: set) -> bool:
        """Rule 2 and 4's adapter limit: a step runs at most max_loras distinct adapters."""
        return seq.request.lora is None or seq.request.lora in adapters or len(adapters) < self.max_loras

    def num_deferred(self) -> int:
        """Waiting sequences held back by a passing limit rather than a lack of room (vLLM's "deferred"):
        a LoRA adapter beyond max_loras, or a recomputed beam whose group has yet to decide."""
        adapters = self._running_adapters()
        return sum(1 for seq in self.waiting if not self._adapter_fits(seq, adapters)
                   or seq.beam_group is not None and seq.beam_group.has_reported(seq.seq_id))

    def _victim(self) -> Sequence:
        """The newest parked beam (it has reported; only its blocks are at stake), else the newest
        running sequence. Neither has been scheduled in this step yet."""
        for seq in reversed(self.running):
            if seq.num_uncomputed_tokens == 0:
                return seq
        return self.running[-1]

    def _unpark_one(self, plan: StepPlan) -> None:
        parked = [seq for seq in self.running if seq.num_uncomputed_tokens == 0]
        if parked:
            self._preempt(parked[-1], plan)

    def _cache_hits(self, seq: Sequence) -> CacheHit:
        # Prompt logprobs (and mean or cls pooling) need every prompt position computed: such requests skip the lookup.
        if not self.blocks.enable_caching or seq.whole_prompt:
            return NO_HIT
        return self.blocks.cached_prefix(seq.token_slice(0, seq.num_tokens), seq.cache_extra, seq.image_keys)

    def _count_cache_lookup(self, seq: Sequence, num_cached: int, num_loaded: int) -> None:
        """vLLM's counts: the device cache's queries and hits, then the tier's (what the device lacked)."""
        if self.blocks.enable_caching and not seq.whole_prompt:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_cached - num_loaded
            if self.blocks.host is not None and self.blocks.host.tier_enabled:
                self.host_cache_queries += seq.num_tokens - (num_cached - num_loaded)
                self.host_cache_hits += num_loaded

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self.num_preemptions += 1
        self.request_stats.preempted(seq)
        live_siblings = sum(1 for s in seq.siblings if s is not seq and not s.status.is_finished)
        mode = choose_preemption(self.limits.preemption_mode, seq, live_siblings,
                                 self.limits.max_num_batched_tokens, self.blocks.can_swap_out(seq.seq_id))
        if mode == "swap":
            # The worker keeps the sequence; only its blocks move. It resumes from where it was.
            plan.swap_out.extend(self.blocks.swap_out(seq.seq_id))
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=_in_order)
            self.num_preemptions_swap += 1
            self.num_swaps_out += 1
            return
        self._recompute(seq, plan)
        self.num_preemptions_recompute += 1

    def _recompute(self, seq: Sequence, plan: StepPlan) -> None:
        """The sequence gives back its blocks and waits at the head of its priority to compute them again."""
        self.blocks.free(seq.seq_id)
        if seq.known_to_worker:
            plan.finished_seq_ids.append(seq.seq_id)
        seq.reset_for_recompute()
        self._enqueue(seq, ahead=True)

    def _describe_work(self, scheduled: dict[int, int], plan: StepPlan) -> None:
        """New sequences in full, known ones as deltas; then their tokens count as in flight."""
        blocks = self.blocks
        for seq in self.running:
            num_tokens = scheduled.get(seq.seq_id)
            if num_tokens is None:
                continue
            seq_tokens, num_blocks = seq.num_tokens, blocks.num_table_blocks(seq.seq_id)
            if not seq.known_to_worker:
                plan.new.append(NewSequence(
                    request_id=seq.request_id, seq_id=seq.seq_id, index=seq.index,
                    prompt_token_ids=seq.prompt_token_ids, output_token_ids=list(seq.output_token_ids),
                    sampling_params=seq.worker_params, block_table=blocks.block_table(seq.seq_id),
                    num_computed_tokens=seq.num_planned_tokens, num_scheduled_tokens=num_tokens,
                    num_siblings=len(seq.pending_siblings), lora=seq.request.lora, pooling=seq.request.pooling,
                    trace_context=seq.request.trace_context, images=seq.request.images))
                seq.known_to_worker = True
            else:
                # Only the blocks added since the last plan (the whole table only when it was
                # replaced): per step, the cost follows the sequences, not their lengths.
                # A placeholder now is the token the step in flight samples: the worker appends its own.
                table = blocks.block_table(seq.seq_id) if seq.table_replaced else None
                added = [] if table is not None or num_blocks == seq.num_blocks_sent else \
                    blocks.block_table(seq.seq_id, seq.num_blocks_sent)
                plan.running.append(running_sequence(
                    seq_id=seq.seq_id, new_token_ids=seq.token_slice(seq.num_tokens_sent, seq_tokens),
                    new_block_ids=added, num_computed_tokens=seq.num_planned_tokens,
                    num_scheduled_tokens=num_tokens + len(seq.inflight_drafts), new_block_table=table,
                    append_last_sample=seq.num_placeholders > 0, draft_token_ids=seq.inflight_drafts))
            seq.table_replaced = False
            seq.num_tokens_sent = seq_tokens + seq.num_placeholders
            seq.num_blocks_sent = num_blocks
            seq.num_inflight_tokens += num_tokens
            if seq.num_uncomputed_tokens == 0:  # this step reaches the end: it samples the next token
                seq.num_placeholders += 1

    def take_drops(self) -> list[int]:
        """Seq ids the worker should forget now, when no step is about to run."""
        drops, self._plan.finished_seq_ids = self._plan.finished_seq_ids, []
        return drops

    # --- results ----------------------------------------------------------------------------------

    def update(self, scheduled: dict[int, int], result: StepResult, seqs: dict[int, Sequence]) -> list[SequenceUpdate]:
        """Advance the scheduled sequences by the step's result (output_processor.py); the updates for the
        front end."""
        if result.failed_block_ids:
            scheduled, result = self._recompute_unfilled(scheduled, result)
        updates = self._outputs.update_from_output(scheduled, result, seqs)
        if self.hands_off:
            self._hand_off_sampled()
        return updates

    def _hand_off_sampled(self) -> None:
        """A prefill stage's sequences that have just sampled (their first token, or the first after a resumption)
        leave it: the worker forgets them, their blocks stay held until the decode stage has pulled them."""
        # Every token computed but the one just sampled, and nothing in flight (a resumed sequence, which has
        # outputs from the start, may be admitted whole in a plan made ahead: it waits for that step).
        for seq in [s for s in self.running if s.output_token_ids and s.num_uncomputed_tokens == 1
                    and not s.num_inflight_tokens and not s.num_placeholders]:
            self.running.remove(seq)
            if seq.known_to_worker:
                self._plan.finished_seq_ids.append(seq.seq_id)
            seq.reset_for_handoff()
            self._handed_off.append(seq)

    def take_handoffs(self) -> list[Sequence]:
        """The sequences handed off since the last call (a prefill stage's), holding their blocks here."""
        handed_off, self._handed_off = self._handed_off, []
        return handed_off

    def take_over(self, seq: Sequence) -> None:
        """A sequence a prefill stage handed off (its kv_source set): it waits here in order, and its admission
        pulls its KV rather than computing it."""
        self._enqueue(seq)

    def _recompute_unfilled(self, scheduled: dict[int, int], result: StepResult) -> tuple[dict[int, int], StepResult]:
        """A swap-in failed on the worker: its blocks leave the prefix caches, and the sequences the worker left
        out of the step for it are preempted for recompute. No step is in flight (see can_plan_ahead), so they
        start again cleanly. Returns the step's scheduled tokens and result without them."""
        self.blocks.forget_cached(set(result.failed_block_ids))
        left_out = set(result.recompute_seq_ids)
        victims = {seq.seq_id: seq for seq in self.running if seq.seq_id in left_out}
        for seq in victims.values():
            self.running.remove(seq)
            self._recompute(seq, self._plan)
        self.num_failed_swap_ins += 1
        return ({seq_id: n for seq_id, n in scheduled.items() if seq_id not in victims},
                dataclasses.replace(result, outputs=[o for o in result.outputs if o.seq_id not in victims]))

    def take_spawned(self) -> list[Sequence]:
        """Sequences the updates created since the last call (beams that forked): the engine registers them."""
        return self._outputs.beams.take_spawned()

    # --- sequences start and end ------------------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child runs from now on, sharing every block of the parent; the worker copies the
        parent's state (the next plan's forks) before this step's tokens are appended."""
        self.blocks.fork(parent.seq_id, child.seq_id)
        self._plan.forks.append(Fork(parent_seq_id=parent.seq_id, child_seq_id=child.seq_id, child_index=child.index))
        child.num_computed_tokens = parent.num_computed_tokens
        child.known_to_worker = True
        child.num_tokens_sent = child.num_tokens
        child.num_blocks_sent = self.blocks.num_table_blocks(child.seq_id)
        child.status = SequenceStatus.RUNNING
        bisect.insort(self.running, child, key=_in_order)

    def wait_first(self, seq: Sequence) -> None:
        """A new sequence that computes its tokens on its own, before anything else waiting (of its priority
        or worse)."""
        self._enqueue(seq, ahead=True)

    def finish_by_stop_string(self, seq: Sequence, stop: str) -> bool:
        """End a sequence whose text hit a stop string; False if it had ended already."""
        if seq.status.is_finished:
            return False
        self.finish(seq, SequenceStatus.FINISHED_STOPPED, stop)
        return True

    def finish(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        """The sequence ends: it leaves its queue, its blocks go back, and the worker is told to drop it."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        elif seq in self.waiting:  # pending siblings wait on their parent, not in the queue
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)
        if seq.known_to_worker:
            self._plan.finished_seq_ids.append(seq.seq_id)
            seq.known_to_worker = False
        seq.finish(status, stop_reason)
        if all(s.status.is_finished for s in reversed(seq.siblings)):  # (live beams are the last ones)
            self.request_stats.observe_finished(seq.siblings)
