"""Decode steps of Llama-family models on CPU as one flat loop of kernel calls.

At batch 1 a decode step of a 30-layer model is ~300 small operations. Run through the model's
modules, each pays nn.Module dispatch, the backend's and the seams' checks (which kernel, which
dtype, which plan), and new tensors for views: about half of a SmolLM2 token's time on a 2-core
CPU, where the weights take 5 ms to read. This is the CPU's counterpart of the CUDA-graph decode
(`cuda_graphs.py`): the checks run once, when the loop is built from the model, and a step calls
the same kernels the modules would call, in the same order, on the same tensors, so its numbers
are the model's (tests/worker/test_cpu_decode.py holds it to that, bit for bit).

It takes steps whose every request decodes one token or brings a few that the paged kernel attends
in place in the modules too (a speculative verification's k + 1 rows: `can_replay`), of models
built from `blocks.py`'s Llama parts (RopeAttention without q/k norms or biases, GatedMLP with SiLU)
with the C++ CPU kernels loaded, one KV group, no window, no LoRA, one rank; a KV cache of the
model's dtype or int8/fp8 (written by the quantizing op, read in place by the same kernel). Anything else runs through the
modules; so does every step with `enforce_eager` or `custom_ops="none"` (the worker builds no loop).

The projections are the layers' business: at a row count's first step the loop asks each layer
for its kernel plan at that many rows (`LinearBase.kernel_plan`, quant/kernel_plan.py: kvflow's
few-row GEMV on its codes, the panel kernel on its panels, or "call me"), and keeps the plans.
Where every product of every layer has a GEMV or panel plan the step runs as one C++ call
(`csrc/cpu_decode_step.cpp`: the same operators in the same order on the same kinds of buffers,
so the same numbers): without ~2 ms of interpreter a SmolLM2 token at batch 1 on the GEMV, and ~12
µs of Python a product at 16 rows on panels, where the products take ~10 ms a step. Otherwise the
plans run from Python, kernel call by kernel call. A quant method that publishes its plans is
taken here without a change to this file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kvflow import cpu_extension
from kvflow.attention import cpu_kv_write, cpu_paged, kv_quant
from kvflow.attention.metadata import AttentionMetadata
from kvflow.attention.torch_sdpa import TorchSDPABackend
from kvflow.model.layers import cpu_ops
from kvflow.model.layers.linear import LinearBase
from kvflow.model.layers.mlp import GatedMLP
from kvflow.model.models.blocks import CausalLM, DecoderLayer, DecoderModel, RopeAttention
from kvflow.quant import panel_linear
from kvflow.quant.kernel_plan import GemvPlan, KernelPlan, PanelPlan

NATIVE_SOURCE = Path(__file__).parent / "csrc" / "cpu_decode_step.cpp"
# How the C++ step runs a product (csrc/cpu_decode_step.cpp's ProductKind).
GEMV, PANELS, GATED_PANELS = 0, 1, 2


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    linears: tuple[LinearBase, LinearBase, LinearBase, LinearBase]  # qkv, o, gate_up, down


@dataclass(frozen=True)
class _Products:
    """One layer's products at one row count: qkv, o, gate_up's fused SiLU·up (None: none, then
    gate_up's plain product and the activation kernel) and down."""

    qkv: KernelPlan
    o: KernelPlan
    gated: KernelPlan | None
    gate_up: KernelPlan | None  # asked for only where `gated` is None
    down: KernelPlan


@dataclass(frozen=True)
class _Step:
    """A row count's plans, and the C++ step's arguments where every plan has a native kernel."""

    products: list[_Products]
    native: tuple[list[torch.Tensor], list[int], int] | None  # tensors, (kind, bits, path) per product, act width



def load_native() -> bool:
    """The C++ decode step's library is loaded (built first if need be)."""
    return cpu_extension.load_library("kvflow_cpu_decode", NATIVE_SOURCE, "the C++ decode step")

class CpuDecodeLoop:
    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], native: bool = True) -> None:
        decoder = model.model
        first = decoder.layers[0].self_attn
        spec = first.attn.spec
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary
        self.final_norm, self.eps = decoder.norm.weight, decoder.norm.eps
        self.heads, self.kv_heads, self.head_dim, self.scale = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.scale
        self.sizes = first.sizes
        self.layers = [
            _Layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, cache[0], cache[1],
                   (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
            for layer, cache in zip(decoder.layers, kv_caches)]
        self.rms_norm = torch.ops.kvflow_cpu_ops.rms_norm
        self.rotate = torch.ops.kvflow_cpu_ops.rotary
        self.silu_and_mul = torch.ops.kvflow_cpu_ops.silu_and_mul
        # An int8 / fp8 cache (kv_quant.py) is quantized as it is written; the kernel reads its codes.
        quantized = kv_quant.is_quantized(kv_caches[0])
        self.write_kv = torch.ops.kvflow_cpu_kv.write_kv_quantized if quantized else torch.ops.kvflow_cpu_kv.write_kv
        self.attend = torch.ops.kvflow_cpu.paged_attention
        self.batch_invariant = first.attn.backend.batch_invariant  # a TorchSDPABackend (_takes)
        # `native=False` keeps every step in Python (the tests hold the C++ step to it).
        self.native = native and load_native()
        self.steps: dict[int, _Step] = {}  # per row count, from its first step (`run`)

    @classmethod
    def build(cls, model: nn.Module, kv_caches: list[torch.Tensor], native: bool = True) -> CpuDecodeLoop | None:
        """The loop for `model`, or None where it does not take this model (see the module's doc)."""
        return cls(model, kv_caches, native) if _takes(model, kv_caches) else None

    def can_replay(self, meta: AttentionMetadata) -> bool:
        """One-token decodes, and chunks the paged kernel attends in place in the modules too
        (`cpu_paged.takes`: a speculative verification's k + 1 rows, a short chunk after its
        context): the same kernel on the same metadata, so the same numbers."""
        return all(n == 1 or (n <= cpu_paged.MAX_QUERIES and n < s)
                   for n, s in zip(meta.query_lens_cpu, meta.seq_lens_cpu))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: tuple[AttentionMetadata, ...]) -> torch.Tensor:
        """As model(input_ids, positions, kv_caches, attn) for a step `can_replay` takes (one KV
        group and no LoRA rows: `build` takes no model that could have others)."""
        meta = attn[0]
        hidden = self.embed(input_ids)
        rows = hidden.shape[0]
        step = self.steps.get(rows)
        if step is None:
            step = self.steps[rows] = self._plan(rows, hidden.dtype)
        tiles = cpu_paged.use_tiles(meta.seq_lens_cpu, self.kv_heads, self.batch_invariant)
        if step.native is not None:
            return self._run_native(hidden, positions, meta, tiles, step.native)
        return self._run_python(hidden, positions, meta, tiles, step.products)

    def _plan(self, rows: int, dtype: torch.dtype) -> _Step:
        products = []
        for layer in self.layers:
            qkv, o, gate_up, down = layer.linears
            gated = gate_up.silu_and_mul_plan(rows, dtype)
            # gate_up's plain product only where the layer has no fused one: asking lays it out
            plain = gate_up.kernel_plan(rows, dtype) if gated is None else None
            products.append(_Products(qkv.kernel_plan(rows, dtype), o.kernel_plan(rows, dtype), gated, plain,
                                      down.kernel_plan(rows, dtype)))
        return _Step(products, _native_arguments(self.layers, products) if self.native else None)

    def _run_python(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    tiles: bool, products: list[_Products]) -> torch.Tensor:
        """The step through the layers' plans, kernel call by kernel call."""
        rows, dtype = hidden.shape[0], hidden.dtype
        requests = torch.arange(len(meta.seq_lens_cpu))
        cos, sin = self.rotary.cos, self.rotary.sin
        q_size, k_size, _ = self.sizes
        eps, heads, kv_heads, d = self.eps, self.heads, self.kv_heads, self.head_dim
        normed = torch.empty_like(hidden)
        attended = torch.empty(rows, heads, d, dtype=dtype)
        residual = None
        for layer, plan in zip(self.layers, products):
            self.rms_norm(normed, hidden, residual, layer.input_norm, eps)
            if residual is None:  # the first layer: the embeddings are the residual stream
                residual = hidden
            qkv = plan.qkv(normed)
            q = qkv[:, :q_size].view(rows, heads, d)
            k = qkv[:, q_size:q_size + k_size].view(rows, kv_heads, d)
            v = qkv[:, q_size + k_size:].view(rows, kv_heads, d)
            self.rotate(q, k, positions, cos, sin)
            self.write_kv(layer.key_cache, layer.value_cache, k, v, meta.slot_mapping)
            self.attend(attended, q, layer.key_cache, layer.value_cache, meta.block_tables, meta.seq_lens,
                        meta.query_start_loc, requests, 0, self.scale, tiles)
            self.rms_norm(normed, plan.o(attended.view(rows, heads * d)), residual, layer.post_norm, eps)
            hidden = plan.down(self._gated(plan, normed))
        out = torch.empty_like(hidden)
        self.rms_norm(out, hidden, residual, self.final_norm, eps)
        return out

    def _gated(self, plan: _Products, x: torch.Tensor) -> torch.Tensor:
        """SiLU(x W_gateᵀ) · (x W_upᵀ): the layer's fused product, or its product and the kernel."""
        if plan.gated is not None:
            return plan.gated(x)
        gate_up = plan.gate_up(x)
        act = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
        self.silu_and_mul(act, gate_up)
        return act

    def _run_native(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, tiles: bool,
                    native: tuple[list[torch.Tensor], list[int], int]) -> torch.Tensor:
        """The Python loop above as one C++ call (csrc/cpu_decode_step.cpp): the same kernels on
        the same buffers, without the interpreter between them."""
        tensors, kinds, act_width = native
        out = torch.empty_like(hidden)
        torch.ops.kvflow_cpu_decode.llama_step(
            out, hidden, positions, self.rotary.cos, self.rotary.sin, meta.slot_mapping, meta.block_tables,
            meta.seq_lens, meta.query_start_loc, torch.arange(len(meta.seq_lens_cpu)), tensors, kinds, self.final_norm,
            self.eps, self.heads, self.kv_heads, self.head_dim, self.scale, act_width, tiles, panel_linear.has_tiles())
        return out


def _native_arguments(layers: list[_Layer], products: list[_Products]) -> tuple[list[torch.Tensor], list[int], int] | None:
    """The C++ step's per-layer tensors (norms, caches, then two per product) and per-product
    (kind, bits, path), and the MLP's intermediate width; None where a plan has no native kernel."""
    tensors, kinds = [], []
    for layer, plan in zip(layers, products):
        gate_up = plan.gated if plan.gated is not None else plan.gate_up
        forms = [_native_form(p, gated=p is plan.gated) for p in (plan.qkv, plan.o, gate_up, plan.down)]
        if any(form is None for form in forms):
            return None
        tensors += [layer.input_norm, layer.post_norm, layer.key_cache, layer.value_cache]
        for form_tensors, form_kinds in forms:
            tensors += form_tensors
            kinds += form_kinds
    return tensors, kinds, layers[0].linears[2].output_sizes[0]


def _native_form(plan: KernelPlan, gated: bool) -> tuple[list[torch.Tensor], list[int]] | None:
    """A plan as the C++ step takes it: two tensors and (kind, bits, path); None: "call me"."""
    if isinstance(plan, GemvPlan) and not gated:  # the C++ step applies SiLU·up after it
        return [plan.codes, plan.scale_zero], [GEMV, plan.bits, plan.path]
    if isinstance(plan, PanelPlan) and plan.gated == gated:
        return [plan.panels, plan.panels.new_empty(0)], [GATED_PANELS if gated else PANELS, 0, 0]
    return None


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
                or type(backend) is not TorchSDPABackend or backend.kernel is None or not layer.mlp.fused_silu
                or any(not isinstance(lin, LinearBase) or lin.bias is not None or lin.tp_size != 1 for lin in linears)
                or not cpu_paged.reads(cache, layer.input_layernorm.weight.dtype) or not cache.is_contiguous()
                or cache.dim() != (4 if kv_quant.is_quantized(cache) else 5)):
            return False
    return (len(decoder.layers) == len(kv_caches) and decoder.embed_tokens.tp_size == 1 and decoder.norm.custom_ops
            and cpu_ops.load() is not None and cpu_kv_write.load_writer() is not None
            and decoder.layers[0].input_layernorm.weight.dtype in cpu_ops.DTYPES)
