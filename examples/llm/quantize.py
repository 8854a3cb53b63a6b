"""Weight-only int8 quantization of the decoder's projections (attention and MLP).

Each `nn.Linear` in the decoder layers becomes an `Int8Linear`: int8 weights, symmetric per
output channel (row), with one fp32 scale per row. The embedding, which is also the tied
output head, stays in full precision: it is read by row for the input and is most of the
logits' error budget if quantized.

    model = quantize_int8(load_model(out_dir))   # in place; returns the same model

Forward picks one of two paths by the number of rows of the input:
- few rows (decoding): `torch._weight_int8pack_mm`, which reads the int8 weights directly;
  fed bf16 activations (its fp32 variant is ~5x slower than bf16 on CPU), fp32 scales after;
- many rows (prefill): the weights cast to the input's dtype, one matmul, then the scales.
Measured on 2 CPU cores, torch 2.13, a 1536x576 projection: 1 row fp32 nn.Linear 105 us,
kernel 34 us, dequantized 118 us; 16 rows 291 / 221 / 467 us; 64 rows 760 / 878 / 955 us.
"""

from __future__ import annotations

import torch
from torch import nn

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Above this many input rows the int8 kernel stops beating a matmul (measured above).
FAST_PATH_MAX_ROWS = 32


def _has_int8_kernel() -> bool:
    op = getattr(torch, "_weight_int8pack_mm", None)
    if op is None:
        return False
    # Present but unimplemented raises; tiny inner sizes (4) crash it, so probe with 64.
    try:
        op(
            torch.ones(1, 64, dtype=torch.bfloat16),
            torch.ones(64, 64, dtype=torch.int8),
            torch.ones(64, dtype=torch.bfloat16),
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True


HAS_INT8_KERNEL = _has_int8_kernel()


class Int8Linear(nn.Module):
    """y = x @ (weight_int8 * scale[:, None]).T (+ bias), without a stored fp32 weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float()
        # Symmetric per row: the largest magnitude maps to 127; an all-zero row keeps scale 1
        # so the division below is defined.
        scale = w.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.register_buffer("weight_int8", q.contiguous())
        self.register_buffer("scale", scale.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        # The kernel's own scales are bf16; ones there keep the fp32 scales exact.
        ones = torch.ones(w.shape[0], dtype=torch.bfloat16)
        self.register_buffer("ones", ones, persistent=False)
        # Inner sizes off a multiple of 16 were seen to crash the kernel; keep to the safe ones.
        self.use_kernel = HAS_INT8_KERNEL and self.in_features % 16 == 0

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls(linear.weight, linear.bias)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight the int8 one stands for (out_features, in_features)."""
        return self.weight_int8.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if (
            self.use_kernel
            and flat.shape[0] <= FAST_PATH_MAX_ROWS
            and flat.device.type == "cpu"
            and flat.dtype == torch.float32
        ):
            low = flat.to(torch.bfloat16).contiguous()
            out = torch._weight_int8pack_mm(low, self.weight_int8, self.ones).float()
            out = out * self.scale
        else:
            # Scaling the output columns equals scaling the weight rows, and touches fewer
            # numbers than dequantizing the weight first.
            out = (flat @ self.weight_int8.to(flat.dtype).T) * self.scale.to(flat.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


@torch.no_grad()
def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every projection `nn.Linear` of `model.model.layers` by an `Int8Linear`, in
    place; the embedding and the tied head are left alone. Returns `model`."""
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in PROJECTIONS:
                linear = getattr(parent, name, None)
                if isinstance(linear, nn.Linear):
                    setattr(parent, name, Int8Linear.from_linear(linear))
    return model


def projection_bytes(model: nn.Module) -> int:
    """Bytes held by the decoder layers' projections (weights and scales)."""
    total = 0
    for module in model.model.layers.modules():
        if isinstance(module, Int8Linear):
            total += module.weight_int8.numel() + module.scale.numel() * 4
        elif isinstance(module, nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total
