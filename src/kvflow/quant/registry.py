"""`quantization=` names (vLLM's where it has them) → the config that gives each layer its method."""

from __future__ import annotations

from kvflow.quant.base import QuantizationConfig

# Applied at load to a float checkpoint (or one saved by `kvflow quantize`, which names its method).
QUANTIZATION_METHODS = ("int8", "int4", "fp8", "mxfp4", "awq", "w8a8", "bitsandbytes", "w4a8", "w4a4")
# Applied at load only: `kvflow quantize` cannot write them yet (w4a8/w4a4's rotation and untied
# head are not a checkpoint; LLM.int8()'s fused layers would need one weight_format per part).
NOT_SAVED = ("bitsandbytes", "w4a8", "w4a4")
ROTATED = ("w4a8", "w4a4")  # quantized after a Hadamard rotation of the model (quant/rotation.py)
# Read from a checkpoint that holds them, never applied to a float one.
CHECKPOINT_FORMATS = ("gptq", "compressed-tensors")


def get_quantization_config(quantization: str | None, group_size: int | None,
                            checkpoint_quant: dict | None, rotation: bool = True) -> QuantizationConfig | None:
    """`quantization` is what the user asked for (None: run the checkpoint as stored);
    `checkpoint_quant` is how the checkpoint stores its weights (a GGUF's blocks, or the
    "quantization_config" of a quantized checkpoint); `rotation`: w4a8/w4a4 rotate the model first."""
    if not rotation and quantization not in ROTATED:
        raise ValueError(f"quantization_rotation applies to {' and '.join(ROTATED)}; quantization is {quantization!r}")
    if quantization in ROTATED and checkpoint_quant is None:
        return _online_configs()[quantization](group_size=group_size, rotate=rotation)
    stored = (checkpoint_quant or {}).get("quant_method")
    if stored == "gguf":
        return _config("gguf", None, checkpoint_quant)
    if stored is not None:
        if quantization is not None and quantization != stored:
            raise ValueError(f"quantization={quantization!r}, but the checkpoint is already quantized with {stored!r}")
        if stored in CHECKPOINT_FORMATS:
            return _checkpoint_config(stored, checkpoint_quant)
        if stored not in QUANTIZATION_METHODS:
            raise ValueError(f"the checkpoint's quantization_config.quant_method is {stored!r}, which kvflow cannot "
                             f"load (supported: {', '.join(QUANTIZATION_METHODS + CHECKPOINT_FORMATS)}, gguf)")
        return _config(stored, group_size, checkpoint_quant)
    if quantization is None:
        return None
    if quantization in CHECKPOINT_FORMATS:
        raise ValueError(f"quantization={quantization!r} loads {quantization} checkpoints, and this one has no "
                         "quantization_config; quantize a float checkpoint with int4, awq or fp8")
    return _config(quantization, group_size, None)


def _checkpoint_config(name: str, stored: dict) -> QuantizationConfig:
    from kvflow.quant.compressed_tensors import NVFP4_FORMAT, CompressedTensorsConfig
    from kvflow.quant.gptq_checkpoint import GPTQConfig
    from kvflow.quant.nvfp4 import Nvfp4Config

    if name == "compressed-tensors" and stored.get("format") == NVFP4_FORMAT:  # FP4 weights, not packed integers
        return Nvfp4Config(stored)
    return {"gptq": GPTQConfig, "compressed-tensors": CompressedTensorsConfig}[name](stored)


def _config(name: str, group_size: int | None, stored: dict | None) -> QuantizationConfig:
    if name == "gguf":
        from kvflow.quant.gguf import GGUFConfig

        return GGUFConfig((stored or {}).get("cache_dir"))
    configs = _online_configs()
    if name not in configs:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {name!r}")
    if stored is not None:
        group_size = stored.get("group_size", group_size)
    if group_size is not None and name not in ("int4", "awq"):
        raise ValueError(f"group_size applies to int4 and awq, not {name}")
    if name == "awq" and stored is not None:  # AutoAWQ's checkpoints keep the embedding float, zero points integer
        return configs[name](group_size, True, int8_embedding=stored.get("embedding") == "int8",
                             float_zeros=stored.get("zeros") == "float")
    if name == "bitsandbytes" and stored is not None:  # transformers' checkpoint: its threshold, its float layers
        return configs[name].from_checkpoint(stored)
    return configs[name](group_size=group_size, from_saved=stored is not None)


def _online_configs() -> dict:
    from kvflow.quant.awq import AWQConfig
    from kvflow.quant.bnb_int8 import BnbInt8Config
    from kvflow.quant.fp8 import Fp8Config
    from kvflow.quant.int4 import Int4Config
    from kvflow.quant.int8 import Int8Config
    from kvflow.quant.mxfp4 import Mxfp4Config
    from kvflow.quant.w4a import W4A4Config, W4A8Config
    from kvflow.quant.w8a8 import W8A8Config

    return {c.name: c for c in (Int8Config, Int4Config, Fp8Config, Mxfp4Config, AWQConfig, W8A8Config, BnbInt8Config,
                                W4A8Config, W4A4Config)}
