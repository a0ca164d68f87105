"""Weight-only quantized linear layers: GGUF block formats read as they are, and int8 per channel.

Every format becomes one form, ``QuantizedWeight``: unsigned integers in blocks of 32 along K, each
block with a float32 scale and offset (w = scale * u + offset), packed once at load into the layout of
the CPU kernel (``engine/csrc/quant_ops.cpp``), GGUF's float16 scales kept as they are. On CUDA GPUs with FP8
tensor cores, ``Fp8Weight`` (e4m3, per-channel scales) runs through ``torch._scaled_mm``.
"""

from engine.quant.fp8 import Fp8Weight, fp8_linear, fp8_supported, quantize_fp8
from engine.quant.int8 import quantize_int8
from engine.quant.weight import QuantizedWeight, concat_rows, dequantize

__all__ = ["Fp8Weight", "QuantizedWeight", "concat_rows", "dequantize", "fp8_linear", "fp8_supported",
           "quantize_fp8", "quantize_int8"]
