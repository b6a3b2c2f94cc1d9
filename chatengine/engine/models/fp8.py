"""FP8 (e4m3) weights for the linear layers: half the bytes of bf16, so a decode step, which reads
every weight once, reads half as much.

Each weight row (output channel) gets its own fp32 scale, amax / 448; each activation row (token)
gets one too, computed every call (one Triton launch on CUDA: kernels/fp8_ops.py). On CUDA one
`torch._scaled_mm` multiplies the e4m3 operands and applies both scales (Hopper's FP8 tensor cores);
elsewhere `fp8_linear_ref` does the same arithmetic on dequantized fp32 copies, the reference the
CUDA path is tested against. Embeddings, the LM head and the norms stay in the model's dtype.
"""

import torch

from chatengine.kernels.fp8_ops import E4M3_MAX, quantize_rows_ref, quantize_rows_triton

quantize_rows = quantize_rows_ref  # weights at load, activations off CUDA
__all__ = ["E4M3_MAX", "check_fp8_device", "fp8_linear", "fp8_linear_cuda", "fp8_linear_ref", "quantize_rows"]


def fp8_linear_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None):
    """y = x W^T (+ b) with x quantized per row and W (N, K) e4m3 with scales (N,), in fp32."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_rows(x2)
    y = (xq.float() * x_scale[:, None]) @ (w.float() * w_scale[:, None]).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def fp8_linear_cuda(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None):
    """fp8_linear_ref's result from one scaled FP8 matmul (row-wise scales; out in x's dtype)."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_rows_triton(x2)
    y = torch._scaled_mm(xq, w.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :], out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], w.shape[0])


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None):
    return (fp8_linear_cuda if x.is_cuda else fp8_linear_ref)(x, w, w_scale, bias)


def check_fp8_device(device: torch.device) -> None:
    """FP8 matmuls need compute capability 8.9+ (Ada, Hopper); a CPU runs the reference path."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"quantization='fp8' needs a GPU of compute capability 8.9 or newer; {name} is not")
