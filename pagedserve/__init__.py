"""pagedserve: LLM serving with PagedAttention. The public front; the code lives in services/ and shared/."""

from services.scheduler.llm import LLM
from shared.outputs import CompletionOutput, Logprob, RequestOutput
from shared.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
