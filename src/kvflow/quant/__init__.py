"""Quantization: one method per file, entered through `QuantMethod` (how a layer's weights are
stored and multiplied) and `QuantizationConfig` (which method each layer gets)."""
