"""The Llama family over a paged KV cache: Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite, Gemma 1/2/3 (whose
differences gemma_config.py lists) and the mixture-of-experts kin Mixtral, Qwen2-MoE and Qwen3-MoE (whose
sparse layers are moe.py's). The model around its decoder layers (decoder.py): embeddings, the final
norm, the logits head, LoRA slots and loading.

``load_weights`` takes Hugging Face names and writes each checkpoint tensor into its slice of the fused
weight (weight_targets.py).

With tensor parallelism the model is built from this rank's share of the config
(its heads and intermediate columns, see tensor_parallel.py): ``load_weights``
takes this rank's rows of q/k/v and gate/up and its columns of o_proj and
down_proj, whose outputs are summed over the ranks (their biases added by rank 0).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.kv_quant import KVScales, checkpoint_kv_scale, scales_from_checkpoint
from services.worker.attention.spec import AttentionSpec
from services.worker.models.decoder import MLP, DecoderLayer
from services.worker.models.int8_linear import Int8Linear
from services.worker.models.layers import RotaryEmbedding, rms_norm_class
from services.worker.models.lora_linear import LoRABatch, LoRALinear, LoRATarget
from services.worker.models.moe import SparseMoeBlock
from services.worker.models.packed_linear import PackedLinear, pack_linear_layers
from services.worker.models.weight_targets import (FUSED_SUFFIXES, HF_MLP_NAMES, MIXTRAL_EXPERT_NAMES, WeightTargets,
                                                   unfuse_checkpoint)
from services.worker.tensor_parallel import TensorParallel
from services.worker.model_config import ModelConfig
from services.worker.multimodal_config import text_checkpoint_name

# A stored-quantized layer in place of a float projection (linear, how it is stored), or None where it cannot be.
StoredLayer = Callable[[nn.Module, Hashable], nn.Module | None]


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = TensorParallel(), kv_replicas: int = 1,
                 with_head: bool = True, num_labels: int = 0, max_model_len: int | None = None):
        """``config``: this rank's share of the model (the whole model on a single rank); ``kv_replicas``:
        how many ranks hold each KV head (more than one when the model has fewer KV heads than ranks);
        ``with_head``: False for a pooling model, which needs no logits (and whose checkpoint may have no head);
        ``num_labels``: a sequence classifier's, whose ``score`` head maps a state to one logit per label;
        ``max_model_len``: the longest context served (None: max_position_embeddings), which picks LongRoPE's
        factor set."""
        super().__init__()
        self.config = config
        self.with_head = with_head
        self.tp = tp
        self.kv_replicas = kv_replicas
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling, config.rotary_dim, max_model_len,
                                      in_float32=config.rotate_in_float32, mrope_section=config.mrope_section)
        # Gemma 3's sliding layers rotate with a base of their own.
        self.local_rotary = None if config.local_rope_theta is None else RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.local_rope_theta, None)
        # Given its (uninitialised) weight: a random init on the meta device imports torch._dynamo, two
        # seconds of every worker's start-up; the checkpoint overwrites it anyway.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i, self._rotary_of(i), tp)
                                    for i in range(config.num_hidden_layers))
        self.norm = rms_norm_class(config.norm_style)(config.hidden_size, config.rms_norm_eps)
        # Tied: the embedding matrix doubles as the output projection (see lm_head_weight).
        if with_head and not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed_logits: PackedLinear | None = None  # set by pack_linear_weights
        self.kv_scales_found: dict[tuple[int, str], float] = {}  # the checkpoint's KV-cache scales (kv_quant.py)
        if num_labels:  # whole on every rank: a few rows
            self.score = nn.Linear(config.hidden_size, num_labels, bias=False)

    def _embedding_multiplier(self, dtype: torch.dtype) -> float:
        """What embeddings are multiplied by: Gemma's sqrt(hidden) first rounded through float32 to ``dtype``
        (transformers rounds it so), Granite's as it is."""
        value = self.config.embedding_multiplier
        if self.config.round_embedding_multiplier:
            value = torch.tensor(value, dtype=torch.float32).to(dtype).item()
        return value

    def _rotary_of(self, layer: int) -> RotaryEmbedding | None:
        if not self.config.uses_rope(layer):
            return None
        if self.local_rotary is not None and self.config.attention_window(layer) is not None:
            return self.local_rotary
        return self.rotary

    def attention_spec(self) -> AttentionSpec:
        """What every attention layer computes: the same for each rank (heads are split, not layers)."""
        config = self.config
        return AttentionSpec(config.attention_scale,
                             tuple(config.attention_window(i) for i in range(config.num_hidden_layers)),
                             config.attn_logit_softcap)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def kv_scales(self) -> KVScales:
        """Each layer's KV-cache scales: the checkpoint's, 1.0 where it has none."""
        return scales_from_checkpoint(self.kv_scales_found, self.config.num_hidden_layers)

    def pack_linear_weights(self) -> None:
        """After loading, on CPU in float32 or bfloat16: every projection, the logits head included, in
        oneDNN's layout.

        The tied head packs a copy and leaves the embedding as it is (lookups still need it).
        """
        pack_linear_layers(self)
        for module in self.modules():
            if isinstance(module, SparseMoeBlock):
                module.pack_experts()
        if self.with_head:
            tied = self.config.tie_word_embeddings
            self.packed_logits = PackedLinear(self.embed_tokens.weight, None) if tied else self.lm_head

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``input_ids`` (``[T, hidden]``), as the first layer takes them."""
        x = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier is not None:  # Gemma, Granite
            x = x * self._embedding_multiplier(x.dtype)
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention,
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm, one row per scheduled token, or only the rows
        ``output_rows`` (int64 indices into the T, on the model's device): the last layer computes no others past
        its attention (services/worker/output_rows.py says why). ``inputs_embeds``: the first layer's input, when
        it is not only the tokens' embeddings (images' features in their place)."""
        x, residual = self.embed(input_ids) if inputs_embeds is None else inputs_embeds, None
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, attention, meta, output_rows if index == last else None)
        if residual is None:  # no layers
            return self.norm(x if output_rows is None else x.index_select(0, output_rows))
        return self.norm.forward_with_residual(x, residual)[0]

    def use_int8_linears(self, stored_int8: Iterable[str], static: bool = False) -> frozenset[str]:
        """Hold as Int8Linear (W8A8) each dense projection whose checkpoint layers are all in ``stored_int8``
        (HF names: q/k/v and gate/up are fused here, so they go together), with each part's static input scale
        where ``static``; before materializing. Returns the checkpoint layers so kept."""
        stored_int8 = set(stored_int8)

        def build(linear: nn.Module, parts: list[str]) -> nn.Module | None:
            present = [part in stored_int8 for part in parts]
            if not any(present):
                return None
            if not all(present):
                raise ValueError(f"{', '.join(parts)} run as one layer here, but only some are stored in int8")
            return Int8Linear(linear.in_features, linear.out_features, linear.bias is not None,
                              static_parts=len(parts) if static else 0)

        return self._replace_projections(build)

    def use_stored_layouts(self, layouts: Mapping[str, Hashable], make: StoredLayer) -> frozenset[str]:
        """Hold as ``make(linear, layout)`` (WNA16Linear.replacing, Fp8Linear.replacing) each dense projection
        whose checkpoint layers all have the same layout in ``layouts`` (HF name -> how it is stored) and that
        ``make`` takes; before materializing. The others are dequantized. Returns the checkpoint layers so kept."""
        def build(linear: nn.Module, parts: list[str]) -> nn.Module | None:
            found = {layouts.get(part) for part in parts}
            return make(linear, next(iter(found))) if len(found) == 1 and None not in found else None

        return self._replace_projections(build)

    def _replace_projections(self, build) -> frozenset[str]:
        """Each dense projection replaced by ``build(linear, its checkpoint layers)`` where that gives a layer;
        the checkpoint layers so replaced."""
        kept = set()
        for owner, attr, parts in self._fused_projections():
            layer = build(getattr(owner, attr), parts)
            if layer is not None:
                setattr(owner, attr, layer)
                kept.update(parts)
        return frozenset(kept)

    def _fused_projections(self) -> Iterable[tuple[nn.Module, str, list[str]]]:
        """(owner, attribute, the checkpoint layers it fuses) for each dense projection."""
        for i, layer in enumerate(self.layers):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            yield layer.self_attn, "qkv_proj", [f"{attn}.{name}_proj" for name in "qkv"]
            yield layer.self_attn, "o_proj", [f"{attn}.o_proj"]
            if isinstance(layer.mlp, MLP):
                yield layer.mlp, "gate_up_proj", [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
                yield layer.mlp, "down_proj", [f"{mlp}.down_proj"]

    def use_fused_experts(self) -> None:
        """Run the mixture-of-experts layers through the Triton kernel (with the Triton attention); not those
        whose experts were packed for oneDNN (float32 on a CPU, under the interpreter)."""
        for module in self.modules():
            if isinstance(module, SparseMoeBlock):
                module.fused = module.packed is None

    def add_lora(self, num_slots: int, max_rank: int) -> tuple[LoRABatch, dict[str, LoRATarget]]:
        """Room for ``num_slots`` adapters beside every attention and dense MLP projection (after loading
        and packing); the batch object that says which tokens use which, and where each PEFT module goes."""
        dtype, device = self.embed_tokens.weight.dtype, self.embed_tokens.weight.device
        batch, targets, tp = LoRABatch(num_slots, dtype, device), {}, self.tp
        hidden = self.config.hidden_size

        def wrap(owner: nn.Module, name: str, in_features: int, parts: dict[str, tuple[int, int, int]],
                 row_parallel: bool, prefix: str) -> None:
            # parts: PEFT module -> (this rank's rows, the whole model's rows or columns, replicas)
            layer = LoRALinear(getattr(owner, name), in_features, [rows for rows, _, _ in parts.values()], batch,
                               max_rank)
            setattr(owner, name, layer)
            for part, (module, (_, whole, replicas)) in enumerate(parts.items()):
                targets[f"{prefix}.{module}"] = LoRATarget(layer, part, row_parallel, whole, replicas)

        for i, decoder in enumerate(self.layers):
            attn, p = decoder.self_attn, f"model.layers.{i}"
            q_whole, kv_whole = attn.q_size * tp.size, attn.kv_size * tp.size // self.kv_replicas
            wrap(attn, "qkv_proj", hidden, {"q_proj": (attn.q_size, q_whole, 1),
                                            "k_proj": (attn.kv_size, kv_whole, self.kv_replicas),
                                            "v_proj": (attn.kv_size, kv_whole, self.kv_replicas)},
                 False, f"{p}.self_attn")
            wrap(attn, "o_proj", attn.q_size, {"o_proj": (hidden, q_whole, 1)}, True, f"{p}.self_attn")
            mlp = decoder.mlp
            if isinstance(mlp, MLP):
                inter = mlp.gate_up_proj.out_features // 2  # nn.Linear and PackedLinear both say
                wrap(mlp, "gate_up_proj", hidden, {"gate_proj": (inter, inter * tp.size, 1),
                                                   "up_proj": (inter, inter * tp.size, 1)}, False, f"{p}.mlp")
                wrap(mlp, "down_proj", inter, {"down_proj": (hidden, inter * tp.size, 1)}, True, f"{p}.mlp")
        return batch, targets

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` in the model's dtype for the rows of ``hidden`` that need sampling (soft-capped
        where the model says: Gemma 2); the sampler widens them to float32 where it needs to."""
        if self.packed_logits is not None:
            logits = self.packed_logits(hidden)
        else:
            logits = F.linear(hidden, self.lm_head_weight)
        if self.config.logits_scaling != 1.0:  # Granite
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcap
        if cap is not None:  # in the model's dtype, as transformers caps them
            logits = torch.tanh(logits / cap) * cap
        return logits

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """A classifier's float32 logits ``[N, num_labels]`` for pooled float32 states ``[N, hidden]`` (in the
        model's dtype, as transformers computes them; the head may be packed, see pack_linear_weights)."""
        return self.score(pooled.to(self.embed_tokens.weight.dtype)).float()

    # ---- loading -----------------------------------------------------------------------------

    def _weight_targets(self) -> WeightTargets:
        """HF parameter name -> where this rank's part of it goes."""
        targets = WeightTargets(self.tp)
        targets.whole("model.embed_tokens.weight", self.embed_tokens.weight)
        targets.whole("model.norm.weight", self.norm.weight)
        if self.with_head and not self.config.tie_word_embeddings:
            targets.whole("lm_head.weight", self.lm_head.weight)
        if hasattr(self, "score"):
            targets.whole("score.weight", self.score.weight)
        for i, layer in enumerate(self.layers):
            p, attn = f"model.layers.{i}", layer.self_attn
            for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm"):
                if hasattr(layer, name):  # which norms a layer has depends on their placement
                    targets.whole(f"{p}.{name}.weight", getattr(layer, name).weight)
            qkv_sizes = [attn.q_size, attn.kv_size, attn.kv_size]
            for suffix in FUSED_SUFFIXES:
                fused = getattr(attn.qkv_proj, suffix, None)
                if fused is not None:
                    targets.parts(f"{p}.self_attn", suffix, fused, ["q_proj", "k_proj", "v_proj"], qkv_sizes,
                                  [1, self.kv_replicas, self.kv_replicas])
            targets.input_scales(f"{p}.self_attn", attn.qkv_proj, ["q_proj", "k_proj", "v_proj"])
            targets.row_parallel(f"{p}.self_attn.o_proj", attn.o_proj, self.config.o_bias)
            if attn.qk_norm and attn.qk_norm_per_head:
                targets.whole(f"{p}.self_attn.q_norm.weight", attn.q_norm.weight)
                targets.whole(f"{p}.self_attn.k_norm.weight", attn.k_norm.weight)
            elif attn.qk_norm:  # over the whole projection: this rank's heads' share of the weight
                targets.parts(f"{p}.self_attn", "weight", attn.q_norm.weight, ["q_norm"], [attn.q_size], [1])
                targets.parts(f"{p}.self_attn", "weight", attn.k_norm.weight, ["k_norm"], [attn.kv_size],
                              [self.kv_replicas])
            if isinstance(layer.mlp, SparseMoeBlock):
                self._expert_targets(targets, p, layer.mlp)
            else:
                targets.mlp(f"{p}.mlp", layer.mlp.gate_up_proj, layer.mlp.down_proj, self.config.mlp_bias)
        return targets

    def _expert_targets(self, targets: WeightTargets, layer_prefix: str, block: SparseMoeBlock) -> None:
        mixtral = self.config.model_type == "mixtral"
        prefix = f"{layer_prefix}.block_sparse_moe" if mixtral else f"{layer_prefix}.mlp"
        targets.whole(f"{prefix}.gate.weight", block.gate.weight)
        targets.experts(f"{prefix}.experts", block.w13, block.w2, MIXTRAL_EXPERT_NAMES if mixtral else HF_MLP_NAMES)
        if block.shared_expert is not None:
            targets.whole(f"{prefix}.shared_expert_gate.weight", block.shared_expert_gate.weight)
            shared = block.shared_expert
            targets.mlp(f"{prefix}.shared_expert", shared.gate_up_proj, shared.down_proj, False)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the model, converting dtype and device."""
        targets = self._weight_targets()
        loaded: set[str] = set()
        if self.config.text_of is not None:  # a multimodal checkpoint: its language model's tensors only
            weights = ((plain, tensor) for name, tensor in weights
                       if (plain := text_checkpoint_name(name)) is not None)
        attn = self.layers[0].self_attn if len(self.layers) else None
        if attn is not None:  # Phi-3 stores q/k/v and gate/up fused: split into the names the targets know
            kv_whole = attn.kv_size * self.tp.size // self.kv_replicas
            weights = unfuse_checkpoint(weights, (attn.q_size * self.tp.size, kv_whole, kv_whole))
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # some old checkpoints saved this buffer; we derive it from the config
            if (kv_scale := checkpoint_kv_scale(name)) is not None:
                self.kv_scales_found[kv_scale] = float(tensor.float().reshape(-1)[0])  # for an FP8 KV cache
                continue
            if name == "lm_head.weight" and (self.config.tie_word_embeddings or not self.with_head):
                continue  # tied: the output projection is the embedding, as in transformers; or no head needed
            if name not in targets and f"model.{name}" in targets:
                name = f"model.{name}"  # a bare model's checkpoint (AutoModel, sentence-transformers) has no prefix
            if name not in targets:
                raise ValueError(f"unexpected weight {name!r} for a {self.config.model_type} model")
            loaded.add(name)
            target = targets[name]
            if target is None:
                continue  # another rank's
            expected = target.source_shape()
            if tuple(tensor.shape) != expected:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
            target.copy_from(tensor)
        missing = sorted(set(targets) - loaded)
        if missing:
            raise ValueError(f"missing weights ({len(missing)}): {', '.join(missing)}")
