"""W8A8 int8 linear layers: int8 weights with a scale per output channel, activations quantized to int8 per
token as they arrive (dynamic, symmetric), as compressed-tensors' W8A8 int8 scheme stores and runs them:

    y[t, n] = s_x[t] * s_w[n] * sum_k q_x[t, k] * q_w[n, k]  (+ bias[n])
    s_x[t] = max_k |x[t, k]| / 127,   q_x = clamp(round(x / s_x), -127, 127)

On a CPU with VNNI the integer product runs in oneDNN's int8 matmul: the weight is reordered once into
oneDNN's layout (``qlinear_prepack``); activations go in as uint8 with zero point 128 (oneDNN's int8
kernels want unsigned activations), the per-channel weight scales are applied by oneDNN and the
per-token activation scale afterwards, row by row (oneDNN takes one activation scale per call).

Without VNNI (AVX2 only) oneDNN multiplies uint8 by int8 with vpmaddubsw, which saturates a pair of
products at 32767: full-range codes (255 x 127 x 2) come out wrong, as this project's CPU host showed
(errors of thousands on a 64-term dot product). So oneDNN is used only where a saturating product checks
exact at start (``onednn_int8_is_exact``); elsewhere the layer runs the plain PyTorch reference below,
in float32, from the int8 weights. On a GPU it runs the Triton int8 GEMM (quantization/int8_gemm.py):
the integer product in int32 on the tensor cores, the scales applied after.

The loader (model_loader.py) builds one for each dense projection a compressed-tensors W8A8 int8
checkpoint stores, fills ``weight`` and ``weight_scale`` and calls ``prepare``.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

QMAX = 127
_ZERO_POINT = 128  # int8 activations shifted into uint8
_TINY = 1e-12  # the scale of a row of zeros: its codes are all 0 whatever it is


def quantize_per_token(x: torch.Tensor, static_scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> (int8 codes ``[..., K]``, float32 scales ``[..., 1]``); round half to even.
    ``static_scale``: a checkpoint's calibrated scale (one value) for every token instead."""
    x = x.float()
    if static_scale is None:
        scale = (x.abs().amax(dim=-1, keepdim=True) / QMAX).clamp_min(_TINY)
    else:
        scale = static_scale.float().reshape([1] * x.dim()).expand(*x.shape[:-1], 1)
    codes = torch.round(x / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    return codes, scale


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight ``[N, K]`` -> (int8 ``[N, K]``, float32 scales ``[N, 1]``), symmetric per output row
    (what a W8A8 checkpoint holds; for tests and for quantizing a float checkpoint at load)."""
    return quantize_per_token(weight)


def w8a8_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                   dtype: torch.dtype = torch.float32, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The scheme's arithmetic in plain PyTorch, the product in ``dtype`` (float64: exact, for tests): the
    oracle, and the path off oneDNN. ``input_scale``: static activations' scale (None: per token)."""
    codes, scale = quantize_per_token(x, input_scale)
    y = (codes.to(dtype) @ weight.to(dtype).t()) * scale.to(dtype) * weight_scale.to(dtype).view(1, -1)
    return y if bias is None else y + bias.to(dtype)


def _shifted_codes(x: torch.Tensor, static_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_per_token`` plus 128, as uint8: oneDNN's int8 activations (in PyTorch)."""
    codes, scale = quantize_per_token(x, None if static_scale is None else torch.tensor(static_scale))
    return (codes.to(torch.int16) + _ZERO_POINT).to(torch.uint8), scale


def _scaled_output(acc: torch.Tensor, row_scales: torch.Tensor | None, bias: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """``(acc * row_scales + bias).to(dtype)``, float32 until the end (in PyTorch)."""
    if row_scales is not None:
        acc = acc.mul_(row_scales)
    if bias is not None:
        acc = acc.add_(bias.float())
    return acc.to(dtype)


def can_run_onednn_int8(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and hasattr(torch.ops, "onednn") \
        and hasattr(torch.ops.onednn, "qlinear_pointwise") and onednn_int8_is_exact()


@functools.cache
def onednn_int8_is_exact() -> bool:
    """Whether oneDNN's int8 matmul on this CPU computes full-range codes exactly: a product whose pairs
    saturate vpmaddubsw's int16 (AVX2 without VNNI) must come out as the integers say."""
    weight = torch.tensor([[127, 127, -127, 127] * 16], dtype=torch.int8)  # [1, 64]
    codes = torch.full((2, 64), 127, dtype=torch.int8)
    codes[1, ::2] = -127
    return _onednn_product(codes, weight).equal(codes.double() @ weight.double().t())


def _onednn_product(codes: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_k codes[t, k] * weight[n, k] through oneDNN, as float64."""
    packed = torch.ops.onednn.qlinear_prepack(weight, None)
    ones, zeros = torch.ones(weight.shape[0]), torch.zeros(weight.shape[0], dtype=torch.int64)
    shifted = (codes.to(torch.int16) + _ZERO_POINT).to(torch.uint8)
    return torch.ops.onednn.qlinear_pointwise(shifted, 1.0, _ZERO_POINT, packed, ones, zeros, None, 1.0, 0,
                                              torch.float32, "none", [], "").double()


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` held as int8 codes ``weight [N, K]`` and ``weight_scale [N, 1]``; with static
    activations, ``input_scale [parts]``: each fused part's calibrated scale (they see the same input; the
    largest is used, as vLLM does)."""

    keeps_dtype = ("weight_scale", "input_scale")  # float32 whatever the model's dtype (the loader leaves them)

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, static_parts: int = 0):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None
        self.input_scale = nn.Parameter(torch.empty(static_parts, dtype=torch.float32, device=device),
                                        requires_grad=False) if static_parts else None
        self._static_scale: torch.Tensor | None = None  # the one input scale used (prepare())
        self._static_value: float | None = None  # the same, as a number (the CPU path's)
        self._gpu_matmul = None  # the Triton GEMM, on a GPU (prepare())
        self._packed: torch.Tensor | None = None  # oneDNN's reordered weight (prepare())
        self._scales: torch.Tensor | None = None  # weight_scale flat, and zero points, as oneDNN takes them
        self._zero_points: torch.Tensor | None = None
        self._quantize = _shifted_codes  # activations -> oneDNN's uint8 codes (the C++ kernel where built)
        self._epilogue = _scaled_output  # oneDNN's float32 product -> the output (the C++ kernel where built)

    def prepare(self, triton_gemm: bool | None = None) -> None:
        """After the weights are loaded: the Triton GEMM where ``triton_gemm`` (None: on a GPU), else reorder
        them for oneDNN where it runs."""
        if triton_gemm is None:
            triton_gemm = self.weight.device.type == "cuda"
        if self.input_scale is not None:
            self._static_scale = self.input_scale.data.max().reshape(1)
            self._static_value = float(self._static_scale.item())
        if triton_gemm and self.weight.device.type == "cuda" and \
                torch.cuda.get_device_capability(self.weight.device) < (8, 0):
            triton_gemm = False  # no int8 tensor-core dot before sm_80: the reference runs
        if triton_gemm:
            from services.worker.quantization.int8_gemm import int8_matmul_with_quantization  # Triton

            self._gpu_matmul = int8_matmul_with_quantization
        elif can_run_onednn_int8(self.weight.device):
            from services.worker.models import cpu_layers

            self._packed = torch.ops.onednn.qlinear_prepack(self.weight.data, None)
            if cpu_layers.available():
                self._quantize, self._epilogue = cpu_layers.quantize_rows_uint8, cpu_layers.int8_epilogue
            self._scales = self.weight_scale.data.view(-1).float().contiguous()
            self._zero_points = torch.zeros(self.out_features, dtype=torch.int64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` (float) -> ``[..., N]`` in x's dtype."""
        static = self._static_scale
        if self._gpu_matmul is not None:
            return self._gpu_matmul(x, self.weight, self.weight_scale, self.bias, static)
        if self._packed is None:
            return w8a8_reference(x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.bias,
                                  input_scale=static).to(x.dtype).view(*x.shape[:-1], self.out_features)
        flat = x.reshape(-1, self.in_features)
        shifted, scale = self._quantize(flat.contiguous(), self._static_value)
        # A static scale is oneDNN's own activation scale; per-token ones multiply its rows afterwards.
        x_scale = 1.0 if static is None else self._static_value
        y = torch.ops.onednn.qlinear_pointwise(shifted, x_scale, _ZERO_POINT, self._packed, self._scales,
                                               self._zero_points, None, 1.0, 0, torch.float32, "none", [], "")
        y = self._epilogue(y, None if static is not None else scale, self.bias, x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"onednn={self._packed is not None}, triton={self._gpu_matmul is not None}"
