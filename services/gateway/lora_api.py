"""vLLM's runtime LoRA endpoints: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Served only with ``--allow-runtime-lora-updating`` (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING), behind
the API keys like every other route. The gateway keeps the adapters it serves (the engine holds no
list of them), so an adapter loaded here is served by this gateway only: with several gateways, load
it at each. Loading reads the adapter's config here (the gateway and the workers see one filesystem in
`serve` and compose) and refuses what the workers could not apply; a request for it then runs as for
an adapter of --lora-modules. Unloading stops new requests for it; those running finish, and its slot
on the workers is taken back when another adapter needs the room.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.generator import Generator
from services.gateway.lora_modules import LoRAModule
from shared.grpc_errors import NotFound
from shared.lora import LoRARequest, read_adapter_config


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; accepted, the name says which


async def load_lora_adapter(gen: Generator, body: LoadLoRAAdapterRequest) -> str:
    model = await gen.model()
    if body.lora_name in model.names or body.lora_name in model.adapters:
        raise ValueError(f"The lora adapter '{body.lora_name}' has already been loaded.")
    read_adapter_config(body.lora_path)  # ValueError: missing, or what no worker applies
    model.adapters[body.lora_name] = LoRAModule(LoRARequest(body.lora_name, body.lora_path), body.base_model_name)
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


async def unload_lora_adapter(gen: Generator, body: UnloadLoRAAdapterRequest) -> str:
    model = await gen.model()
    if model.adapters.pop(body.lora_name, None) is None:
        raise NotFound(f"The lora adapter '{body.lora_name}' cannot be found.")
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
