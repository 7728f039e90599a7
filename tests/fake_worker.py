"""A worker without a model, for scheduler tests: it keeps the worker's view of every sequence,
checks every plan against the protocol, and 'samples' a token derived from the sequence."""

from __future__ import annotations

from shared.step_protocol import SequenceOutput, StepPlan, StepResult, WorkerInfo


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int = 512, vocab_size: int = 100,
                 eos_token_ids: tuple[int, ...] = (0,)):
        self.info = WorkerInfo(model="fake", num_kv_blocks=num_blocks, block_size=block_size,
                               max_model_len=max_model_len, vocab_size=vocab_size, eos_token_ids=eos_token_ids,
                               device="cpu", dtype="float32")
        self.seqs: dict[int, dict] = {}
        self.plans: list[StepPlan] = []
        self.block_owner: dict[int, int] = {}  # block id -> seq id writing it

    def worker_info(self) -> WorkerInfo:
        return self.info

    def shutdown(self) -> None:
        pass

    def token_for(self, seq: dict) -> int:
        return 1 + (seq["seq_id"] * 31 + len(seq["tokens"]) * 7) % (self.info.vocab_size - 1)

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        batch = []
        for new in plan.new:
            assert new.seq_id not in self.seqs, "new sequence the worker already holds"
            seq = {"seq_id": new.seq_id, "tokens": new.prompt_token_ids + new.output_token_ids,
                   "table": list(new.block_table), "computed": new.num_computed_tokens}
            self.seqs[new.seq_id] = seq
            batch.append((seq, new.num_scheduled_tokens))
        for delta in plan.running:
            seq = self.seqs[delta.seq_id]
            seq["tokens"] += delta.new_token_ids
            seq["table"] += delta.new_block_ids
            assert seq["computed"] == delta.num_computed_tokens
            batch.append((seq, delta.num_scheduled_tokens))
        outputs = []
        bs = self.info.block_size
        users: dict[int, int] = {}  # block -> live sequences holding it (prefix-cache sharing)
        for seq in self.seqs.values():
            for block in seq["table"]:
                users[block] = users.get(block, 0) + 1
        for seq, n in batch:
            assert n >= 1
            end = seq["computed"] + n
            written = {seq["table"][pos // bs] for pos in range(seq["computed"], end)}
            assert all(users[b] == 1 for b in written), "a shared block was written in place"
            assert end <= len(seq["tokens"]), "scheduled past the known tokens"
            assert len(seq["table"]) == -(-end // bs), "table does not cover exactly the computed tokens"
            seq["computed"] = end
            if end == len(seq["tokens"]):
                outputs.append(SequenceOutput(seq_id=seq["seq_id"], token_id=self.token_for(seq)))
        return StepResult(step_id=plan.step_id, outputs=outputs)
