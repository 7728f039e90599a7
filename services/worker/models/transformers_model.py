"""Any causal LM through transformers' own modelling code, over the paged KV cache (--model-impl
transformers, or auto for an architecture with no native model here), as vLLM's Transformers backend.

transformers' model is loaded from the checkpoint as transformers loads it (meta device, then the
checkpoint's tensors, in the worker's dtype), with its attention implementation set to the function this
module registers in transformers' AttentionInterface. Every attention layer calls that function with its
q, k and v (after its own rotary or none); the function hands them to the worker's attention backend,
which writes k and v into the layer's KV blocks through the step's slot mapping and attends over the
sequence's blocks, as for a native model. The batch runs as one flat sequence of the step's tokens
(batch 1, each token at its own position), so transformers builds no mask (the registered mask
function returns none): the backend knows where each sequence starts.

At load a probe forward over two tokens records what each attention layer does (its scale, heads,
window, soft cap) and refuses what the backends cannot do (attention sinks, a bidirectional layer, KV
heads that differ between layers)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.spec import AttentionSpec
from services.worker.model_config import ModelConfig
from services.worker.models.lora_linear import LoRABatch, LoRALinear, LoRATarget
from services.worker.models.packed_linear import PackedLinear, can_pack, pack_linear_layers

ATTENTION_NAME = "pagedserve_paged"
STEP_KWARG = "pagedserve_step"  # how a forward's step reaches the attention function through transformers' kwargs


@dataclass
class LayerCall:
    """What one attention layer passed to the attention function."""
    scale: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None
    softcap: float | None


@dataclass
class Step:
    """One forward's attention: the backend and the step's metadata (None: the load-time probe, which
    attends without a cache and records each layer's call)."""
    attention: object | None
    meta: AttentionMetadata | None
    calls: int = 0  # attention layers run so far: the next one's index
    probed: list[LayerCall] = field(default_factory=list)


def paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query ``[1, heads, T, head_dim]``, key and value ``[1, kv_heads, T,
    head_dim]``; returns ``[1, T, heads, head_dim]``."""
    step: Step | None = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError("this model's layers did not pass the forward's arguments on to attention")
    layer, step.calls = step.calls, step.calls + 1
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [T, heads, head_dim]
    if step.attention is None:
        return _probe(step, module, q, k, v, scaling, kwargs), None
    return step.attention.forward(layer, q, k, v, step.meta).unsqueeze(0), None


def _probe(step: Step, module: nn.Module, q, k, v, scaling: float | None, kwargs: dict) -> torch.Tensor:
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ValueError("its attention layers have attention sinks, which the paged attention backends lack")
    if getattr(module, "is_causal", True) is False:
        raise ValueError("an attention layer attends both ways (is_causal False); the paged KV cache is causal")
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    step.probed.append(LayerCall(float(scale), q.shape[1], k.shape[1], q.shape[2], kwargs.get("sliding_window"),
                                 kwargs.get("softcap")))
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(groups, 1).transpose(0, 1),
                                         v.repeat_interleave(groups, 1).transpose(0, 1), is_causal=True, scale=scale)
    return out.transpose(0, 1).unsqueeze(0)


def register_paged_attention() -> None:
    """Make ATTENTION_NAME an attention implementation transformers' models accept (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, lambda *args, **kwargs: None)  # the backend masks


class TransformersCausalLM(nn.Module):
    """transformers' model behind the worker's model interface (that of llama.LlamaForCausalLM)."""

    def __init__(self, hf_model: nn.Module, spec: AttentionSpec, config: ModelConfig):
        super().__init__()
        self.config = config  # its shape as the worker reads it (the KV cache, LoRA's checks)
        self.hf = hf_model
        self.decoder = hf_model.base_model  # the stack without its head: hidden states after the final norm
        self.head = hf_model.get_output_embeddings()
        self.spec = spec
        self.num_layers = len(spec.windows)
        config = hf_model.config
        # What the CausalLM class does to logits after its head (transformers' names): Cohere multiplies them,
        # Granite divides them, Gemma 2 caps them.
        self.logit_scale = float(getattr(config, "logit_scale", None) or 1.0)
        self.logits_scaling = float(getattr(config, "logits_scaling", None) or 1.0)
        self.final_logit_softcap = getattr(config, "final_logit_softcapping", None)

    def attention_spec(self) -> AttentionSpec:
        return self.spec

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``input_ids`` (``[T, hidden]``), as the model's own embedding makes them (Gemma's
        scaled)."""
        return self.hf.get_input_embeddings()(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention,
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]``, one row per scheduled token, or only the rows ``output_rows`` (computed for
        every row: the modelling code runs its layers whole). ``inputs_embeds``: the first layer's input when
        images' features stand in their placeholders' place; ``positions`` ``[T]``, or M-RoPE's ``[3, T]``."""
        step = Step(attention, meta)
        tokens = {"input_ids": input_ids[None]} if inputs_embeds is None else {"inputs_embeds": inputs_embeds[None]}
        out = self.decoder(**tokens, position_ids=positions.unsqueeze(-2), use_cache=False, **{STEP_KWARG: step})
        if step.calls != self.num_layers:
            raise RuntimeError(f"the model ran {step.calls} attention layers, its probe {self.num_layers}")
        hidden = out.last_hidden_state[0]
        return hidden if output_rows is None else hidden.index_select(0, output_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if self.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits  # in the model's dtype, as LlamaForCausalLM.compute_logits returns them

    def pack_linear_weights(self) -> None:
        """On CPU in float32 or bfloat16: transformers' Linear layers (and GPT-2's Conv1D, a Linear with its weight
        transposed) in oneDNN's layout, as the native models' (packed_linear.py)."""
        from transformers.pytorch_utils import Conv1D

        # A vision-language model's vision modules stay as they are: the image encoder shares them, and some
        # (SigLIP's pooling head) read a Linear's weight themselves.
        pack_linear_layers(self.hf, skip=self._vision_modules())
        for parent in list(self.hf.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, Conv1D):  # y = x @ W + b, W [in, out]
                    setattr(parent, name, PackedLinear(child.weight.t().contiguous(), child.bias))
        self.head = self.hf.get_output_embeddings()

    def _vision_modules(self) -> tuple[nn.Module, ...]:
        """A vision-language model's vision tower and projector (the image encoder's, shared): left out of
        packing and of LoRA, whose adapters serve the language model's tokens."""
        inner = getattr(self.hf, "model", None)
        return tuple(part for name in ("vision_tower", "visual", "multi_modal_projector")
                     if isinstance(part := getattr(inner, name, None), nn.Module))

    def use_fused_experts(self) -> None:
        """transformers' experts run its own way."""

    def add_lora(self, num_slots: int, max_rank: int) -> tuple[LoRABatch, dict[str, LoRATarget]]:
        """Room for ``num_slots`` adapters beside every linear projection but the head, named as transformers
        names the module (so as PEFT names its targets); one part each (a fused projection's adapter covers it
        whole, as PEFT trains it)."""
        from transformers.pytorch_utils import Conv1D

        weight = self.hf.get_input_embeddings().weight
        batch, targets = LoRABatch(num_slots, weight.dtype, weight.device), {}
        vision = {id(module) for part in self._vision_modules() for module in part.modules()}
        linear = [(name, parent, child_name, child) for name, parent in self.hf.named_modules()
                  if id(parent) not in vision for child_name, child in parent.named_children()
                  if isinstance(child, (nn.Linear, PackedLinear, Conv1D)) and child is not self.head]
        for name, parent, child_name, child in linear:
            in_features, out_features = child.weight.shape if isinstance(child, Conv1D) else \
                (child.in_features, child.out_features)
            layer = LoRALinear(child, in_features, [out_features], batch, max_rank)
            setattr(parent, child_name, layer)
            targets[f"{name}.{child_name}" if name else child_name] = LoRATarget(layer, 0, False, out_features)
        return batch, targets


def probe(hf_model: nn.Module, device: torch.device) -> list[LayerCall]:
    """Each attention layer's call over a two-token forward (its weights loaded)."""
    step = Step(None, None)
    with torch.inference_mode():
        hf_model.base_model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device),
                            position_ids=torch.arange(2, device=device)[None], use_cache=False, **{STEP_KWARG: step})
    return step.probed


def attention_spec_of(calls: list[LayerCall]) -> AttentionSpec:
    """One spec for every layer; what a paged backend cannot do as the layers ask is refused."""
    if not calls:
        raise ValueError("its attention does not go through transformers' attention interface (no layer called "
                         "it), so the paged KV cache cannot serve it")
    for what in ("scale", "num_heads", "num_kv_heads", "head_dim", "softcap"):
        values = {getattr(call, what) for call in calls}
        if len(values) > 1:
            raise ValueError(f"its attention layers differ in {what} ({sorted(values, key=str)}); the paged KV cache "
                             "holds one shape for all")
    if calls[0].num_heads % calls[0].num_kv_heads:
        raise ValueError(f"{calls[0].num_heads} query heads do not share {calls[0].num_kv_heads} KV heads evenly")
    return AttentionSpec(calls[0].scale, tuple(call.window for call in calls), calls[0].softcap)


def load_hf_model(model_dir: Path, dtype: torch.dtype, device: torch.device, trust_remote_code: bool) -> nn.Module:
    """transformers' model of the checkpoint: its causal LM, or for a vision-language checkpoint the whole model
    (the worker's image encoder then shares its vision modules)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from services.worker.model_impl import model_type_of
    from services.worker.multimodal_config import TAKES_IMAGES

    register_paged_attention()
    implementation: str | dict = ATTENTION_NAME
    auto = AutoModelForCausalLM
    if model_type_of(model_dir) in TAKES_IMAGES:  # the vision tower attends over a whole image, not the KV cache
        auto, implementation = AutoModelForImageTextToText, {"": ATTENTION_NAME, "text_config": ATTENTION_NAME,
                                                             "vision_config": "sdpa"}
    model = auto.from_pretrained(model_dir, dtype=dtype, attn_implementation=implementation,
                                                 trust_remote_code=trust_remote_code, local_files_only=True)
    return model.to(device).eval().requires_grad_(False)  # (a device_map would need accelerate)


def load_transformers_model(model_dir: Path, shape: ModelConfig, dtype: torch.dtype, device: torch.device,
                            trust_remote_code: bool) -> tuple[TransformersCausalLM, ModelConfig]:
    """The model and its shape as its attention layers showed it to the probe (the KV cache is sized by it)."""
    hf_model = load_hf_model(model_dir, dtype, device, trust_remote_code)
    try:
        calls = probe(hf_model, device)
        spec = attention_spec_of(calls)
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"{model_dir}: model_type {shape.model_type!r} cannot be served through transformers: "
                         f"{exc}") from None
    first = calls[0]
    shape = dataclasses.replace(shape, num_hidden_layers=len(calls), num_attention_heads=first.num_heads,
                                num_key_value_heads=first.num_kv_heads, head_dim=first.head_dim)
    model = TransformersCausalLM(hf_model, spec, shape)
    if can_pack(dtype, device):
        model.pack_linear_weights()
    return model, shape
