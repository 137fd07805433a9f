"""Decode steps of Llama-family models on CPU as one flat loop of kernel calls.

At batch 1 a decode step of a 30-layer model is ~300 small operations. Run through the model's
modules, each pays nn.Module dispatch, the backend's and the seams' checks (which kernel, which
dtype, which plan), and new tensors for views: about half of a SmolLM2 token's time on a 2-core
CPU, where the weights take 5 ms to read. This is the CPU's counterpart of the CUDA-graph decode
(`cuda_graphs.py`): the checks run once, when the loop is built from the model, and a step calls
the same kernels the modules would call, in the same order, on the same tensors, so its numbers
are the model's (tests/worker/test_cpu_decode.py holds it to that, bit for bit).

It takes steps whose every request decodes one token, of models built from `blocks.py`'s Llama
parts (RopeAttention without q/k norms or biases, GatedMLP with SiLU) with the C++ CPU kernels
loaded, one KV group, no window, no LoRA, one rank; a KV cache of the model's dtype or int8/fp8
(written by the quantizing op, read in place by the same kernel). Anything else runs through the
modules.
`KVFLOW_CPU_DECODE_LOOP=0` switches it off (A/B measurements).

The loop runs as one C++ call (`csrc/cpu_decode_step.cpp`: the same operators in the same order
on the same kinds of buffers, so the same numbers) where every projection takes one kind of
kernel at the step's row count:
- kvflow's few-row GEMV (int4 planes: the default GGUF, or `--quantization int4`; int8 rows:
  `--quantization int8`) up to `int4_gemv.MAX_ROWS` rows: without ~2 ms of interpreter a
  SmolLM2 token;
- the panel kernel's bf16 products (`quant/panel_linear.py`: a bf16 model's packed weights, or
  the int4 planes' dense copy past the GEMV's rows): ~12 µs of Python a product and ~1 ms of
  other calls a step at 16 rows, where the products themselves take ~10 ms. Which panels a
  layer multiplies is read from the layers at the first step of each row count, and kept. The
  MLPs' gated pairs must exist by then: the first product of more than the GEMV's rows builds
  them (the warm-up's, or any prompt's); a row count met before stays in Python.
`KVFLOW_CPU_DECODE_STEP=0` keeps the Python loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from kvflow import cpu_extension
from kvflow.attention import cpu_kv_write, cpu_paged, kv_quant
from kvflow.attention.metadata import AttentionMetadata
from kvflow.attention.torch_sdpa import TorchSDPABackend
from kvflow.model.layers import activation, cpu_ops
from kvflow.model.layers.linear import LinearBase
from kvflow.model.layers.mlp import GatedMLP
from kvflow.model.models.blocks import CausalLM, DecoderLayer, DecoderModel, RopeAttention
from kvflow.quant import int4_gemv, panel_linear
from kvflow.quant.gguf import GGUFMethod
from kvflow.quant.int4pack import Int4Planes
from kvflow.quant.online import OnlineQuantMethod
from kvflow.quant.packed_linear import DenseWeight, PackedWeight
from kvflow.quant.unquantized import UnquantizedMethod

DISABLE_ENV = "KVFLOW_CPU_DECODE_LOOP"
NATIVE_DISABLE_ENV = "KVFLOW_CPU_DECODE_STEP"
NATIVE_SOURCE = Path(__file__).parent / "csrc" / "cpu_decode_step.cpp"
Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor | None]  # gate_up and SiLU·up in one pass, or None: the layer's own
    down: Linear
    key_cache: torch.Tensor
    value_cache: torch.Tensor


class CpuDecodeLoop:
    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor]) -> None:
        decoder = model.model
        first = decoder.layers[0].self_attn
        spec = first.attn.spec
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary
        self.final_norm, self.eps = decoder.norm.weight, decoder.norm.eps
        self.heads, self.kv_heads, self.head_dim, self.scale = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.scale
        self.sizes = first.sizes
        self.layers = [
            _Layer(layer.input_layernorm.weight, _linear(layer.self_attn.qkv_proj), _linear(layer.self_attn.o_proj),
                   layer.post_attention_layernorm.weight, _linear(layer.mlp.gate_up_proj),
                   layer.mlp.gate_up_proj.silu_and_mul, _linear(layer.mlp.down_proj), cache[0], cache[1])
            for layer, cache in zip(decoder.layers, kv_caches)]
        self.rms_norm = torch.ops.kvflow_cpu_ops.rms_norm
        self.rotate = torch.ops.kvflow_cpu_ops.rotary
        self.silu_and_mul = torch.ops.kvflow_cpu_ops.silu_and_mul
        # An int8 / fp8 cache (kv_quant.py) is quantized as it is written; the kernel reads its codes.
        quantized = kv_quant.is_quantized(kv_caches[0])
        self.write_kv = torch.ops.kvflow_cpu_kv.write_kv_quantized if quantized else torch.ops.kvflow_cpu_kv.write_kv
        self.attend = torch.ops.kvflow_cpu.paged_attention
        self.batch_invariant = first.attn.backend.batch_invariant  # a TorchSDPABackend (_takes)
        self.native = _native_step(decoder, self.layers)
        self.decoder = decoder
        # The C++ step on panels: per row count, its layers' tensors (None: not on panels); filled
        # at a row count's first step (`run`). None without the library.
        self.panel_steps: dict[int, list[torch.Tensor] | None] | None = (
            {} if _native_library() and self.final_norm.dtype == torch.bfloat16 else None)

    @classmethod
    def build(cls, model: nn.Module, kv_caches: list[torch.Tensor]) -> CpuDecodeLoop | None:
        """The loop for `model`, or None where it does not take this model (see the module's doc)."""
        if os.environ.get(DISABLE_ENV, "1") == "0" or not _takes(model, kv_caches):
            return None
        return cls(model, kv_caches)

    def can_replay(self, query_lens: list[int]) -> bool:
        return all(n == 1 for n in query_lens)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: tuple[AttentionMetadata, ...]) -> torch.Tensor:
        """As model(input_ids, positions, kv_caches, attn) for a step of one-token decodes (one KV
        group and no LoRA rows: `build` takes no model that could have others)."""
        meta = attn[0]
        hidden = self.embed(input_ids)
        rows = hidden.shape[0]
        tiles = cpu_paged.use_tiles(meta.seq_lens_cpu, self.kv_heads, self.batch_invariant)
        if self.native is not None and rows <= int4_gemv.MAX_ROWS:
            return self._run_native(hidden, positions, meta, tiles)
        steps = self.panel_steps  # None: no C++ step here
        if steps is not None and rows not in steps:  # read from the layers once a row count
            steps[rows] = _panel_layers(self.decoder, self.layers, rows)
        panels = steps[rows] if steps is not None else None
        if panels is not None and panel_linear.available():
            return self._run_panels(hidden, positions, meta, tiles, panels)
        return self._run_python(hidden, positions, meta, tiles)

    def _run_python(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    tiles: bool) -> torch.Tensor:
        """The step through the layers' own callables, kernel call by kernel call."""
        rows, dtype = hidden.shape[0], hidden.dtype
        requests = torch.arange(rows)
        cos, sin = self.rotary.cos, self.rotary.sin
        q_size, k_size, _ = self.sizes
        eps, heads, kv_heads, d = self.eps, self.heads, self.kv_heads, self.head_dim
        normed = torch.empty_like(hidden)
        attended = torch.empty(rows, heads, d, dtype=dtype)
        act = None
        residual = None
        for layer in self.layers:
            self.rms_norm(normed, hidden, residual, layer.input_norm, eps)
            if residual is None:  # the first layer: the embeddings are the residual stream
                residual = hidden
            qkv = layer.qkv(normed)
            q = qkv[:, :q_size].view(rows, heads, d)
            k = qkv[:, q_size:q_size + k_size].view(rows, kv_heads, d)
            v = qkv[:, q_size + k_size:].view(rows, kv_heads, d)
            self.rotate(q, k, positions, cos, sin)
            self.write_kv(layer.key_cache, layer.value_cache, k, v, meta.slot_mapping)
            self.attend(attended, q, layer.key_cache, layer.value_cache, meta.block_tables, meta.seq_lens,
                        meta.query_start_loc, requests, 0, self.scale, tiles)
            self.rms_norm(normed, layer.o(attended.view(rows, heads * d)), residual, layer.post_norm, eps)
            fused = layer.silu_and_mul(normed)
            if fused is None:
                gate_up = layer.gate_up(normed)
                if act is None:
                    act = torch.empty(rows, gate_up.shape[1] // 2, dtype=dtype)
                self.silu_and_mul(act, gate_up)
            hidden = layer.down(act if fused is None else fused)
        out = torch.empty_like(hidden)
        self.rms_norm(out, hidden, residual, self.final_norm, eps)
        return out

    def _run_native(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    tiles: bool) -> torch.Tensor:
        """The Python loop above as one C++ call (csrc/cpu_decode_step.cpp): the same kernels on
        the same buffers, without the interpreter between them."""
        tensors, bits, gate_up_width, gemv_path = self.native
        out = torch.empty_like(hidden)
        torch.ops.kvflow_cpu_decode.llama_step(
            out, hidden, positions, self.rotary.cos, self.rotary.sin, meta.slot_mapping, meta.block_tables,
            meta.seq_lens, meta.query_start_loc, torch.arange(hidden.shape[0]), tensors, bits, self.final_norm,
            self.eps, self.heads, self.kv_heads, self.head_dim, self.scale, gate_up_width, gemv_path, tiles)
        return out

    def _run_panels(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, tiles: bool,
                    layer_tensors: list[torch.Tensor]) -> torch.Tensor:
        """The Python loop as one C++ call with every product on the panel kernel."""
        out = torch.empty_like(hidden)
        torch.ops.kvflow_cpu_decode.llama_step_panels(
            out, hidden, positions, self.rotary.cos, self.rotary.sin, meta.slot_mapping, meta.block_tables,
            meta.seq_lens, meta.query_start_loc, torch.arange(hidden.shape[0]), layer_tensors, self.final_norm,
            self.eps, self.heads, self.kv_heads, self.head_dim, self.scale, layer_tensors[4].shape[0] * 16, tiles,
            panel_linear.has_tiles())
        return out


def _native_library() -> bool:
    """The C++ step's library is loaded (built first if need be), and KVFLOW_CPU_DECODE_STEP is not 0."""
    return os.environ.get(NATIVE_DISABLE_ENV, "1") != "0" and cpu_extension.load_library(
        "kvflow_cpu_decode", NATIVE_SOURCE, "the C++ decode step")


def _panel_layers(decoder: DecoderModel, layers: list[_Layer], rows: int) -> list[torch.Tensor] | None:
    """Per layer, the tensors of the C++ step on panels for `rows` rows (input norm, qkv panels, o
    panels, post norm, gate_up's gated panels, down panels, key and value caches), or None where a
    product of that many rows runs elsewhere."""
    tensors = []
    for module, layer in zip(decoder.layers, layers):
        attn, mlp = module.self_attn, module.mlp
        qkv, o, down = (_panels(lin, rows) for lin in (attn.qkv_proj, attn.o_proj, mlp.down_proj))
        gate_up = _gated_panels(mlp.gate_up_proj, rows)
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        tensors += [layer.input_norm, qkv, o, layer.post_norm, gate_up, down, layer.key_cache, layer.value_cache]
    return tensors


def _packed(layer: LinearBase, rows: int) -> tuple[PackedWeight, object] | None:
    """The packed bf16 weight the layer's product of `rows` bf16 rows multiplies, and what holds
    its gated pair (`packed_linear.gated_silu_and_mul`'s owner); None where it multiplies other
    weights (int4 kernels, int8 rows, ...)."""
    if type(layer.quant_method) is UnquantizedMethod:
        holder, packed = layer, getattr(layer, "packed_weight", None)
    else:
        holder = _weights(layer)
        if isinstance(holder, Int4Planes):
            packed = holder.packed_for(rows, torch.bfloat16)
        elif isinstance(holder, DenseWeight):
            packed = holder.packed_weight
        else:
            return None
    return (packed, holder) if isinstance(packed, PackedWeight) else None


def _panels(layer: LinearBase, rows: int) -> torch.Tensor | None:
    packed = _packed(layer, rows)
    return packed[0].panels_for(rows) if packed is not None else None


def _gated_panels(layer: LinearBase, rows: int) -> torch.Tensor | None:
    """The gated pair's panels, once the layer's `silu_and_mul` has built the pair."""
    packed = _packed(layer, rows)
    pair = getattr(packed[1], "gated", None) if packed is not None else None
    return pair.panels_for(rows) if pair is not None else None


def _native_step(decoder: DecoderModel, layers: list[_Layer]) -> tuple[list[torch.Tensor], list[int], int, int] | None:
    """The C++ step's per-layer tensors and code widths, the gate_up width and how the GEMVs compute
    (the layers' own choice), or None where it cannot run: a projection without the few-row GEMV
    form, a model not in bfloat16, or no library."""
    if os.environ.get(NATIVE_DISABLE_ENV, "1") == "0":
        return None
    tensors, bits = [], []
    for module, layer in zip(decoder.layers, layers):
        attn, mlp = module.self_attn, module.mlp
        gemvs = [_gemv(lin) for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(g is None for g in gemvs):
            return None
        qkv, o, gate_up, down = gemvs
        tensors += [layer.input_norm, qkv.weight, qkv.scale_zero, o.weight, o.scale_zero, layer.post_norm,
                    gate_up.weight, gate_up.scale_zero, down.weight, down.scale_zero, layer.key_cache,
                    layer.value_cache]
        bits += [g.bits for g in gemvs]
    if decoder.norm.weight.dtype != torch.bfloat16 or not _native_library():
        return None
    return tensors, bits, gemvs[2].out_features, gemvs[0].path


def _weights(layer: LinearBase) -> nn.Module | None:
    """The module the layer's call comes down to where a quant method only forwards to one: a GGUF
    layer of one part, or an online-quantized layer (int4, int8, ...), without a bias."""
    if layer.bias is not None:
        return None
    if isinstance(layer.quant_method, GGUFMethod) and len(layer.gguf_parts) == 1:
        return layer.gguf_parts[0]
    if isinstance(layer.quant_method, OnlineQuantMethod):  # AWQ and w8a8 have none until they are calibrated
        return getattr(layer, "quant_runtime", None)
    return None


def _gemv(layer: LinearBase) -> int4_gemv.Int4Gemv | None:
    """The few-row GEMV form of the layer's weights (held by int4 planes or int8 rows), or None."""
    gemv = getattr(_weights(layer), "gemv", None)
    return gemv if isinstance(gemv, int4_gemv.Int4Gemv) else None


def _linear(layer: LinearBase) -> Linear:
    """The layer as a callable: the module its call comes down to, without the two module calls and
    the quant method around it, where there is one."""
    weights = _weights(layer)
    return layer if weights is None else weights.forward


def _takes(model: nn.Module, kv_caches: list[torch.Tensor]) -> bool:
    decoder = getattr(model, "model", None)
    if not isinstance(model, CausalLM) or type(decoder).forward is not DecoderModel.forward:
        return False
    for layer, cache in zip(decoder.layers, kv_caches):
        if type(layer) is not DecoderLayer or type(layer.self_attn) is not RopeAttention or type(layer.mlp) is not GatedMLP:
            return False
        attn = layer.self_attn
        spec = attn.attn.spec
        backend = attn.attn.backend
        linears = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if (attn.qk_norm is not None or spec.sliding_window is not None or not spec.writes_kv or spec.kv_group != 0
                or type(backend) is not TorchSDPABackend or backend.kernel is None
                or layer.mlp.act_and_mul is not activation.silu_and_mul
                or any(not isinstance(lin, LinearBase) or lin.bias is not None or lin.tp_size != 1 for lin in linears)
                or not cpu_paged.reads(cache, layer.input_layernorm.weight.dtype) or not cache.is_contiguous()
                or cache.dim() != (4 if kv_quant.is_quantized(cache) else 5)):
            return False
    return (len(decoder.layers) == len(kv_caches) and decoder.embed_tokens.tp_size == 1
            and cpu_ops.enabled() and cpu_ops.load() is not None and cpu_kv_write.load_writer() is not None
            and decoder.layers[0].input_layernorm.weight.dtype in cpu_ops.DTYPES)
