"""Weight-only quantized linear layers: GGUF block formats read as they are, and int8 per channel.

Every format becomes one form, ``QuantizedWeight``: unsigned integers in blocks of 32 along K, each
block with a float32 scale and offset (w = scale * u + offset), packed once at load into the layout of
the CPU kernel (``engine/csrc/quant_ops.cpp``). GGUF's scales are float16, so float32 holds them exactly.
"""

from engine.quant.int8 import quantize_int8
from engine.quant.weight import QuantizedWeight, concat_rows, dequantize

QUANTIZATIONS = ("auto", "none", "int8", "gguf")

__all__ = ["QUANTIZATIONS", "QuantizedWeight", "concat_rows", "dequantize", "quantize_int8"]
