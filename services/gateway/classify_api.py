"""vLLM's /classify over a sequence classifier: each input's class scores (the model's activation over
its score head's logits, or the raw logits with ``use_activation`` false) and its best label. Its inputs
are pooling_inputs' (``input``, or vLLM's chat form ``messages``); each is one engine request.
"""

from __future__ import annotations

import time

from services.gateway.api_keys import ApiKey
from services.gateway.generator import Generator
from services.gateway.pooling_inputs import PoolingRequest, pool_inputs, pooling_usage
from shared.invalid_parameter import InvalidParameter
from shared.pooling import PoolingParams


class ClassificationRequest(PoolingRequest):
    use_activation: bool | None = None  # vLLM's: false gives the logits

    def pooling_params(self) -> PoolingParams:
        try:
            return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens,
                                 use_activation=self.use_activation, task="classify")
        except ValueError as exc:
            raise InvalidParameter.from_params_error(exc) from None


def best_label(labels: tuple[str, ...], scores: list[float]) -> str:
    return labels[max(range(len(scores)), key=scores.__getitem__)]


async def create_classification(gen: Generator, body: ClassificationRequest, request_id: str,
                                api_key: ApiKey | None = None) -> dict:
    model, lora, runs = await pool_inputs(gen, body, body.pooling_params(), request_id, api_key)
    labels = model.pooler.labels
    data = [{"index": run.position, "label": best_label(labels, run.embedding), "probs": run.embedding,
             "num_classes": len(run.embedding)} for run in runs]
    return {"id": f"classify-{request_id}", "object": "list", "created": int(time.time()),
            "model": model.answer_name(lora), "data": data, "usage": pooling_usage(runs)}
