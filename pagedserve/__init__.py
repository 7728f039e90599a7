"""pagedserve: LLM serving with PagedAttention. The public front; the code lives in services/ and shared/."""

from shared.lora import LoRARequest
from shared.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput,
                            EmbeddingRequestOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput,
                            ScoringOutput, ScoringRequestOutput)
from shared.pooling import PoolingParams
from shared.sampling_params import SamplingParams
from shared.structured_outputs import StructuredOutputs
from shared.version import __version__

__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputs", "RequestOutput", "CompletionOutput", "Logprob",
           "PoolingParams", "EmbeddingRequestOutput", "EmbeddingOutput", "ClassificationRequestOutput",
           "ClassificationOutput", "ScoringRequestOutput", "ScoringOutput", "PoolingRequestOutput", "PoolingOutput"]


def __getattr__(name: str):
    # LLM brings the engine and torch with it: imported on first use, so that `pagedserve gateway`
    # and `pagedserve scheduler` (which import this package for the CLI) never load torch.
    if name == "LLM":
        from pagedserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
