"""GPU kernels used by the pipeline (Triton, imported lazily: importing this never needs triton)."""

from weight_transfer.kernels.fp8_triton import (
    quantize_fp8,
    quantize_fp8_blockwise_gpu,
    triton_available,
)

__all__ = ["quantize_fp8", "quantize_fp8_blockwise_gpu", "triton_available"]
