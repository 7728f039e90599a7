"""What a model's attention computes besides softmax(q k^T * scale) v, the same for every backend.

Sliding-window attention (Mistral, Qwen2 with ``use_sliding_window``, Gemma 2/3, Phi-3): a query at
position ``p`` sees keys ``p - window + 1 .. p`` (``window`` keys, itself included), as transformers'
sliding mask (``kv_idx > q_idx - window``). Models mix windowed and full layers, so the window is per
layer. Soft-capping (Gemma 2): each scaled score ``s`` becomes ``cap * tanh(s / cap)`` before the mask.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionSpec:
    scale: float  # multiplies q . k (usually head_dim ** -0.5)
    windows: tuple[int | None, ...] = ()  # per layer; None, or a layer past the end: the whole context
    logit_softcap: float | None = None  # None: scores are not capped

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"attention scale must be positive, got {self.scale}")
        for window in self.windows:
            if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
                raise ValueError(f"a sliding window must be a positive number of tokens, got {window!r}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"logit_softcap must be positive, got {self.logit_softcap}")

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if layer < len(self.windows) else None

    def widest_window(self, num_layers: int) -> int | None:
        """The most keys any of the model's layers sees back from a query; None if one sees them all.

        Blocks wholly before that many keys back from a sequence's next token are never read again."""
        windows = [self.window(layer) for layer in range(num_layers)]
        return None if None in windows or not windows else max(windows)


def kv_window(*specs: tuple[AttentionSpec, int]) -> int | None:
    """The widest window over every (spec, layer count) of the models sharing the block tables."""
    widest = [spec.widest_window(num_layers) for spec, num_layers in specs]
    return None if None in widest else max(widest)
