"""Quantized weights: one canonical in-memory form, read from every checkpoint format.

`weight.QuantizedWeight` is what `layers.linear` meets instead of an array; `config` says which
method a model uses (config.json's `quantization_config` or the `quantization` engine argument);
one module per checkpoint format (`gptq`, `awq`, `compressed_tensors`, `fp8`) turns its tensors
into the canonical form; `loader` places them, sharded like the weight they replace.
"""
