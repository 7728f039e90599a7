"""The executor for a tensor-parallel group: the same plan to every rank, rank 0's result back.

Each rank holds part of every layer and the ranks add up their partial sums among themselves
(torch.distributed), so each step needs all of them, in lockstep: a plan goes to every rank's Steps
stream, and the step is done when every rank has answered. The ranks sample identically (they end
the step with the same hidden states and the same sampler state), so their results agree; a
disagreement would put the ranks' copies of the sequences out of step with each other and with the
scheduler, and fails the step rather than being served.
"""

from __future__ import annotations

import dataclasses

from services.scheduler.grpc_executor import GrpcExecutor
from shared.grpc_errors import ServiceUnavailable
from shared.step_protocol import StepPlan, StepResult, WorkerInfo

# What every rank must report alike (the rest: the smallest pools serve all).
_SAME = ("model", "block_size", "max_model_len", "vocab_size", "eos_token_ids", "dtype", "protocol_version",
         "num_speculative_tokens", "pooler", "kv_window")


class TensorParallelExecutor:
    def __init__(self, addresses: list[str], connect_timeout_s: float = 60.0):
        self.ranks: list[GrpcExecutor] = []
        try:
            for address in addresses:
                self.ranks.append(GrpcExecutor(address, connect_timeout_s))
            self._info = group_info([rank.worker_info() for rank in self.ranks], addresses)
        except BaseException:
            self.shutdown()
            raise

    def worker_info(self) -> WorkerInfo:
        return self._info

    @property
    def address(self) -> str:
        """The ranks' addresses, for messages."""
        return ", ".join(rank.address for rank in self.ranks)

    def worker_healthy(self, timeout_s: float = 1.0) -> bool:
        return all(rank.worker_healthy(timeout_s) for rank in self.ranks)

    def stream_ended(self) -> bool:
        return any(rank.stream_ended() for rank in self.ranks)

    def submit(self, plan: StepPlan) -> None:
        for rank in self.ranks:
            rank.submit(plan)

    def wait(self) -> StepResult:
        results, failure = [], None
        for rank in self.ranks:  # every rank's answer is read, so none is left behind the others
            try:
                results.append(rank.wait())
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        expected = _tokens_of(results[0])
        for i, result in enumerate(results[1:], start=1):
            if _tokens_of(result) != expected:
                raise ServiceUnavailable(f"tensor-parallel rank {i} sampled other tokens than rank 0 in step "
                                         f"{result.step_id}: the ranks no longer compute alike")
        return results[0]

    def execute(self, plan: StepPlan) -> StepResult:
        self.submit(plan)
        return self.wait()

    def shutdown(self) -> None:
        for rank in self.ranks:
            rank.shutdown()


def group_info(infos: list[WorkerInfo], addresses: list[str]) -> WorkerInfo:
    """The facts of the workers at ``addresses`` together, after checking that they are the ranks of
    one group, in order, all of them, of one model (a single worker: a group of one)."""
    for i, (info, address) in enumerate(zip(infos, addresses)):
        if (info.tensor_parallel_rank, info.tensor_parallel_size) != (i, len(infos)):
            raise ValueError(f"the worker at {address} is rank {info.tensor_parallel_rank} of "
                             f"{info.tensor_parallel_size}, but was given as rank {i} of {len(infos)}: list a "
                             "tensor-parallel group's workers in rank order, all of them")
        for name in _SAME:
            if getattr(info, name) != getattr(infos[0], name):
                raise ValueError(f"the tensor-parallel ranks disagree on {name}: {getattr(infos[0], name)!r} at "
                                 f"{addresses[0]}, {getattr(info, name)!r} at {address}")
    swap = min(i.num_cpu_blocks - i.num_cpu_offload_blocks for i in infos)
    offload = min(i.num_cpu_offload_blocks for i in infos)
    return dataclasses.replace(infos[0], num_kv_blocks=min(i.num_kv_blocks for i in infos),
                               num_cpu_blocks=swap + offload, num_cpu_offload_blocks=offload)


def _tokens_of(result: StepResult) -> list[tuple]:
    return [(o.seq_id, o.token_id, o.accepted_token_ids, o.draft_token_ids, [s.token_id for s in o.siblings])
            for o in result.outputs]
