"""A worker without a model, for scheduler tests. It keeps the worker's view of every sequence,
checks every plan against the protocol, and simulates the KV pools: each slot holds the token
whose KV was written there, block moves move those contents, and before computing, every token
of a sequence's context must be found in its own slot. So a lost swap, a bad copy-on-write, a
shared block written in place or a wrong prefix-cache hit shows up as a wrong context.

With ``num_speculative_tokens`` it also proposes drafts, some right and some wrong (its tokens are
a function of the sequence and its length, so it knows which), and verifies them: an accepted
draft's KV must later read as the token it became.

With ``kv_window`` it reports a sliding window on every layer, and reads and counts only what the
Triton kernel may read: from the window's first key rounded down to 16. A slot holds a hash of the
whole prefix up to its token, so a block reused by another sequence cannot pass by chance.

With ``fail_swap_ins`` the swap-ins of that many steps (the first that have any) fail as a real
worker reports it: their destination blocks are filled with garbage, the sequences holding them are
left out, and the result names the blocks and those sequences (``failed_block_ids``,
``recompute_seq_ids``).

For prefill/decode disaggregation, ``peers`` maps addresses to the fake workers a plan's pulls read
from; with ``fail_pulls`` the pulls of that many steps fail alike (garbage, left out, reported)."""

from __future__ import annotations

from shared.step_protocol import PositionLogprobs, Sample, SequenceOutput, StepPlan, StepResult, WorkerInfo


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int = 512, vocab_size: int = 100,
                 eos_token_ids: tuple[int, ...] = (0,), num_cpu_blocks: int = 0, num_speculative_tokens: int = 0,
                 kv_window: int | None = None, num_cpu_offload_blocks: int = 0,
                 fail_swap_ins: int = 0, fail_pulls: int = 0, image_token_id: int | None = None,
                 whole_images: bool = False):
        self.info = WorkerInfo(model="fake", num_kv_blocks=num_blocks, block_size=block_size,
                               max_model_len=max_model_len, vocab_size=vocab_size, eos_token_ids=eos_token_ids,
                               device="cpu", dtype="float32", num_cpu_blocks=num_cpu_blocks,
                               num_speculative_tokens=num_speculative_tokens, kv_window=kv_window,
                               num_cpu_offload_blocks=num_cpu_offload_blocks, image_token_id=image_token_id,
                               whole_images=whole_images)
        self.fail_swap_ins = fail_swap_ins  # steps with swap-ins left to fail
        self.fail_pulls = fail_pulls  # steps with pulls left to fail
        self.peers: dict[str, FakeWorker] = {}  # the workers pulls read from, by address
        self.num_accepted = 0  # drafts accepted, over all steps
        self.seqs: dict[int, dict] = {}
        self.plans: list[StepPlan] = []
        self.device = {b: [None] * block_size for b in range(num_blocks)}
        self.host = {b: [None] * block_size for b in range(num_cpu_blocks)}

    def worker_info(self) -> WorkerInfo:
        return self.info

    def first_read(self, position: int) -> int:
        """The first key a query at ``position`` may load (the Triton kernel's rounded window start)."""
        window = self.info.kv_window
        return 0 if window is None else max(0, position - window + 1) // 16 * 16

    def live_table(self, seq: dict) -> list[int]:
        """The blocks the sequence's next query may read: released ones (before them) hold anything."""
        return seq["table"][self.first_read(seq["computed"]) // self.info.block_size:]

    def shutdown(self) -> None:
        pass

    def token_for(self, seq: dict, stream: int = 0, length: int | None = None) -> int:
        length = len(seq["tokens"]) if length is None else length
        return 1 + (seq["seq_id"] * 31 + length * 7 + stream * 13) % (self.info.vocab_size - 1)

    def drafts_for(self, seq: dict) -> list[int]:
        """Up to k drafts after the sequence's tokens (the sampled one included): right ones, then
        from a position on (chosen by the sequence and its length) wrong ones."""
        k = self.info.num_speculative_tokens
        length = len(seq["tokens"]) + 1
        count = (seq["seq_id"] + length) % (k + 1)
        right = (seq["seq_id"] * 5 + length * 3) % (count + 1)
        drafts = [self.token_for(seq, length=length + j) for j in range(count)]
        return [t if j < right else 1 + t % (self.info.vocab_size - 1) for j, t in enumerate(drafts)]

    def logprobs_for(self, seq: dict) -> PositionLogprobs | None:
        """Distinct candidates with falling log-probabilities (what a beam search reads)."""
        k = seq.get("logprobs")
        if k is None:
            return None
        vocab = self.info.vocab_size - 1
        first = self.token_for(seq)
        ids = [1 + (first - 1 + 7 * i) % vocab for i in range(k)]
        shift = (seq["seq_id"] * 3 + len(seq["tokens"])) % 5 / 10
        return PositionLogprobs(ids[0], -0.1 - shift, 1, ids, [-0.1 - shift - 0.3 * i for i in range(k)])

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for fork in plan.forks:
            parent = self.seqs[fork.parent_seq_id]
            self.seqs[fork.child_seq_id] = {**parent, "seq_id": fork.child_seq_id, "tokens": list(parent["tokens"]),
                                            "table": list(parent["table"]), "siblings": 0, "last_sample": None}
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        unfilled = self._move(plan)
        batch = self._apply(plan)
        left_out = [seq["seq_id"] for seq, _ in batch if not unfilled.isdisjoint(seq["table"])]
        batch = [(seq, n) for seq, n in batch if unfilled.isdisjoint(seq["table"])]
        users: dict[int, int] = {}  # block -> live sequences holding it (forks, prefix-cache hits)
        for seq in self.seqs.values():
            if seq.get("swapped"):
                continue  # its table is stale until a swap-in replaces it
            for block in self.live_table(seq):
                users[block] = users.get(block, 0) + 1
        outputs = [out for seq, n in batch if (out := self._compute(seq, n, users)) is not None]
        return StepResult(step_id=plan.step_id, outputs=outputs, failed_block_ids=sorted(unfilled),
                          recompute_seq_ids=left_out)

    def _move(self, plan: StepPlan) -> set[int]:
        """Apply the plan's block moves; the device blocks a failed swap-in left unfilled."""
        # A swap-out moves all of a sequence's blocks, which is how a sequence is seen to leave.
        out = {src for src, _ in plan.swap_out}
        for seq in self.seqs.values():
            if (live := self.live_table(seq)) and set(live) <= out:
                seq["swapped"] = True
        for src, dst in plan.swap_out:
            self.host[dst] = list(self.device[src])
        unfilled = set()
        if plan.swap_in and self.fail_swap_ins:
            self.fail_swap_ins -= 1
            unfilled = {dst for _, dst in plan.swap_in}
        for src, dst in plan.swap_in:
            self.device[dst] = ["garbage"] * self.info.block_size if dst in unfilled else list(self.host[src])
        failed_pulls = bool(plan.pulls) and self.fail_pulls > 0
        self.fail_pulls -= failed_pulls
        for pull in plan.pulls:
            for src, dst in pull.moves:
                if failed_pulls:
                    unfilled.add(dst)
                    self.device[dst] = ["garbage"] * self.info.block_size
                else:
                    self.device[dst] = list(self.peers[pull.source].device[src])
        moved = [(dst, list(self.device[src])) for src, dst in plan.copies]
        for dst, contents in moved:
            self.device[dst] = contents
        return unfilled

    def _apply(self, plan: StepPlan) -> list[tuple[dict, int]]:
        batch = []
        for new in plan.new:
            assert new.seq_id not in self.seqs, "new sequence the worker already holds"
            seq = {"seq_id": new.seq_id, "tokens": new.prompt_token_ids + new.output_token_ids,
                   "table": list(new.block_table), "computed": new.num_computed_tokens, "index": new.index,
                   "siblings": new.num_siblings, "logprobs": new.sampling_params.logprobs}
            self.seqs[new.seq_id] = seq
            batch.append((seq, new.num_scheduled_tokens))
        for delta in plan.running:
            seq = self.seqs[delta.seq_id]
            own, seq["last_sample"] = seq.get("last_sample"), None
            seq["tokens"] += delta.new_token_ids
            if delta.append_last_sample:
                assert own is not None, "told to append a sample the sequence did not draw in its last step"
                seq["tokens"].append(own)
            seq["table"] = list(delta.new_block_table) if delta.new_block_table is not None \
                else seq["table"] + delta.new_block_ids
            seq["drafts"] = list(delta.draft_token_ids)
            seq["swapped"] = False
            assert seq["computed"] == delta.num_computed_tokens
            batch.append((seq, delta.num_scheduled_tokens))
        return batch

    def _compute(self, seq: dict, n: int, users: dict[int, int]) -> SequenceOutput | None:
        bs = self.info.block_size
        drafts, seq["drafts"] = seq.get("drafts", []), []
        inputs = seq["tokens"] + drafts
        start, end = seq["computed"], seq["computed"] + n
        assert n >= 1 and end <= len(inputs), "scheduled past the known tokens"
        assert not drafts or end == len(inputs), "drafts must follow every token of the sequence"
        assert len(seq["table"]) == -(-end // bs), "table does not cover exactly the computed tokens"
        for pos in range(self.first_read(start), start):  # the context it reads must be intact
            assert self.device[seq["table"][pos // bs]][pos % bs] == hash(tuple(seq["tokens"][:pos + 1])), \
                f"seq {seq['seq_id']}: KV of position {pos} is wrong"
        for pos in range(start, end):
            block = seq["table"][pos // bs]
            assert users[block] == 1, "a shared block was written in place"
            self.device[block][pos % bs] = hash(tuple(inputs[:pos + 1]))
        seq["computed"] = end
        if end < len(inputs):
            return None
        length = len(seq["tokens"])
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == self.token_for(seq, length=length + accepted):
            accepted += 1
        seq["computed"] = end - (len(drafts) - accepted)
        if drafts:  # the protocol's rule: the table keeps the blocks the computed tokens fill
            del seq["table"][-(-seq["computed"] // bs):]
        self.num_accepted += accepted
        out = SequenceOutput(seq_id=seq["seq_id"], token_id=self.token_for(seq, length=length + accepted),
                             logprobs=self.logprobs_for(seq), accepted_token_ids=drafts[:accepted])
        if out.logprobs is not None and accepted:
            out.accepted_logprobs = [self.logprobs_for({**seq, "tokens": seq["tokens"] + drafts[:j]})
                                     for j in range(accepted)]
        if self.info.num_speculative_tokens:
            out.draft_token_ids = self.drafts_for({**seq, "tokens": seq["tokens"] + drafts[:accepted]})
        seq["last_sample"] = out.token_id if not accepted else None
        out.siblings = [Sample(self.token_for(seq, i)) for i in range(1, seq["siblings"] + 1)]
        seq["siblings"] = 0
        return out
