"""What each layer keeps in the KV cache, and how layers are grouped to share block tables.

A layer declares one spec:
- `FullAttentionSpec`: K and V of every head for every position;
- `SlidingWindowSpec`: the same, but a query at p reads only keys p - window < k <= p, so blocks
  that left the window can be freed while the request runs;
- `MLAAttentionSpec`: multi-head latent attention keeps one compressed latent plus the decoupled
  RoPE key per position, shared by all heads;
- `SharedKVSpec`: the layer reads an earlier layer's KV and writes none (cross-layer sharing);
- `MambaStateSpec`: a recurrent layer's state (a state-space model's convolution inputs and scan
  state): a fixed size per request whatever its length, so a request holds one block of a state
  group, its *state slot*, from its first token to its end;
- `ShortConvStateSpec`: a gated short convolution's state (LFM2): the convolution's last inputs
  only, no scan; a state as `MambaStateSpec`'s is in every other respect (both are
  `RecurrentStateSpec`s, which is all the layout, the pool and the planner ask).

Layers with equal specs form a *KV group* with its own block table per request. All groups draw
from one pool of blocks, so every group's block must cost the same memory: a spec with L layers
is split into groups of G layers, G the greatest common divisor of the spec counts (vLLM's
hybrid allocator does the same). Gemma-3-270M (15 sliding, 3 full layers) has G = 3: five sliding
groups and one full group; block b of any group holds G layers' KV, slot j of the group in the
j-th of G KV tensors.

A hybrid (state layers beside attention layers: Bamba, LFM2) keeps its states apart from that pool.
One state is megabytes (Bamba-9B: 4.3 MB a layer) where an attention block of 16 tokens is 64 KB,
so one page size for both (vLLM's way) would mean attention blocks of ~1000 tokens, or every
attention block the size of a state. Instead the attention layers form the block pool's groups
as above, and the state layers of each state spec form one *state group* whose slots are a pool
of their own: a request holds one slot in it from its first chunk to its end, and slots are
counted by requests (at most max_num_seqs run), never by the attention pool's blocks. A model of
state layers only (Mamba-2) has no attention pool: its blocks are its states.

Plain dataclasses, no torch: the planner, the scheduler and the worker all read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class FullAttentionSpec:
    num_kv_heads: int
    head_dim: int

    @property
    def elements_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim  # K and V

    @property
    def vectors_per_token(self) -> int:
        return 2 * self.num_kv_heads  # a quantized cache keeps one scale per head's K and V

    @property
    def sliding_window(self) -> int | None:
        return None


@dataclass(frozen=True)
class SlidingWindowSpec:
    num_kv_heads: int
    head_dim: int
    window: int  # a query at p sees keys k with p - k < window

    @property
    def elements_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def vectors_per_token(self) -> int:
        return 2 * self.num_kv_heads

    @property
    def sliding_window(self) -> int | None:
        return self.window


@dataclass(frozen=True)
class MLAAttentionSpec:
    kv_lora_rank: int  # the compressed latent c_KV
    qk_rope_head_dim: int  # the decoupled RoPE key, shared by every head

    @property
    def elements_per_token(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def vectors_per_token(self) -> int:
        return 1

    @property
    def sliding_window(self) -> int | None:
        return None


@dataclass(frozen=True)
class SharedKVSpec:
    target_layer: int  # the earlier layer whose KV this layer reads

    @property
    def elements_per_token(self) -> int:
        return 0

    @property
    def vectors_per_token(self) -> int:
        return 0

    @property
    def sliding_window(self) -> int | None:
        return None  # it holds nothing, so there is nothing to cap


class RecurrentStateSpec:
    """A layer whose memory of a request is one state of `state_elements` float32 numbers, whatever
    the request's length: nothing per token, no window."""

    @property
    def state_elements(self) -> int:
        raise NotImplementedError

    @property
    def elements_per_token(self) -> int:
        return 0  # the state does not grow with the request

    @property
    def vectors_per_token(self) -> int:
        return 0

    @property
    def sliding_window(self) -> int | None:
        return None


@dataclass(frozen=True)
class MambaStateSpec(RecurrentStateSpec):
    conv_dim: int  # channels of the causal convolution (x, B and C)
    conv_kernel: int  # its width: the state keeps that many inputs per channel
    num_heads: int
    head_dim: int
    state_size: int  # the scan state per head is head_dim x state_size

    @property
    def state_elements(self) -> int:
        """float32 numbers of one request's state in one layer: the convolution's inputs, then the
        scan state (kvflow.model.models.mamba2 lays them out)."""
        return self.conv_dim * self.conv_kernel + self.num_heads * self.head_dim * self.state_size


@dataclass(frozen=True)
class ShortConvStateSpec(RecurrentStateSpec):
    conv_dim: int  # channels of the depthwise causal convolution
    conv_kernel: int  # its width

    @property
    def state_elements(self) -> int:
        """The convolution's last conv_kernel - 1 inputs per channel, all the next token reads
        (kvflow.model.layers.short_conv lays them out)."""
        return self.conv_dim * (self.conv_kernel - 1)


STATE_BYTES = 4  # states are float32 whatever the model's dtype: the scan sums every token into them

KVCacheSpec = (FullAttentionSpec | SlidingWindowSpec | MLAAttentionSpec | SharedKVSpec | MambaStateSpec
               | ShortConvStateSpec)

# `kv_cache_dtype` settings: "auto" keeps KV in the model's dtype; the others store one byte per
# number plus a bfloat16 scale per vector, one head's K or V at one position
# (kvflow.attention.kv_quant). "fp8_e4m3" is vLLM's other name for the same E4M3 codes;
# "fp8_e5m2" stores E5M2 codes (vLLM's flag too), in the same bytes.
QUANTIZED_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "int8")
KV_CACHE_DTYPE_CHOICES = "auto, " + ", ".join(QUANTIZED_KV_CACHE_DTYPES[:-1]) + " or " + QUANTIZED_KV_CACHE_DTYPES[-1]
KV_SCALE_BYTES = 2


def token_bytes(spec: KVCacheSpec, dtype_bytes: float, kv_cache_dtype: str = "auto") -> float:
    """What one token costs in a layer of this spec; `dtype_bytes`: the model's dtype ("auto")."""
    if kv_cache_dtype == "auto":
        return spec.elements_per_token * dtype_bytes
    if kv_cache_dtype not in QUANTIZED_KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be {KV_CACHE_DTYPE_CHOICES}; got {kv_cache_dtype!r}")
    return spec.elements_per_token + spec.vectors_per_token * KV_SCALE_BYTES


def kv_bytes_per_token(specs: list[KVCacheSpec], dtype_bytes: float, kv_cache_dtype: str = "auto") -> float:
    """KV bytes one token adds over all layers, before any window cap: the planner's figure and
    the pool's per-token cost."""
    return sum(token_bytes(s, dtype_bytes, kv_cache_dtype) for s in specs)


@dataclass(frozen=True)
class KVGroup:
    spec: KVCacheSpec
    layers: tuple[int, ...]  # slot j of the group is layers[j]


@dataclass(frozen=True)
class KVLayout:
    """The groups, and where each layer's KV lives: (group, slot). A sharing layer has its
    target's place."""

    groups: tuple[KVGroup, ...]
    places: tuple[tuple[int, int], ...]  # per layer

    @property
    def group_size(self) -> int:
        """Layers per block-pool group: KV tensors to allocate, one per slot (a hybrid's state
        layers have tensors of their own, `state_layers`)."""
        return len(self.groups[self.pool_groups()[0]].layers)

    @property
    def hybrid(self) -> bool:
        """State groups beside attention groups: the states get slots of their own, apart from the
        block pool."""
        return self.holds_state and not all(self.state_groups)

    @cached_property
    def state_layers(self) -> tuple[int, ...]:
        """A hybrid's layers that keep a recurrent state, each in a slot tensor of its own (none for
        a model of state layers only, whose states are the pool's blocks)."""
        if not self.hybrid:
            return ()
        return tuple(layer for g in self.groups if isinstance(g.spec, RecurrentStateSpec) for layer in g.layers)

    def state_bytes(self, layers: range | None = None) -> int:
        """A hybrid's memory of one request's states in its state layers (those of `layers` only,
        for a pipeline stage): what a state slot costs."""
        specs = {layer: g.spec for g in self.groups if isinstance(g.spec, RecurrentStateSpec) for layer in g.layers}
        return sum(specs[i].state_elements * STATE_BYTES for i in self.state_layers if layers is None or i in layers)

    def pool_groups(self) -> list[int]:
        """The groups whose blocks the block pool holds: a hybrid's attention groups, else all."""
        return [g for g, state in enumerate(self.state_groups) if not (state and self.hybrid)]

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        return tuple(g.spec.sliding_window for g in self.groups)

    @property
    def state_groups(self) -> tuple[bool, ...]:
        """Per group: whether it holds recurrent states (one block per request) rather than KV."""
        return tuple(isinstance(g.spec, RecurrentStateSpec) for g in self.groups)

    @property
    def holds_state(self) -> bool:
        return any(self.state_groups)

    def block_bytes(self, block_size: int, dtype_bytes: int, kv_cache_dtype: str = "auto",
                    layers: range | None = None) -> int:
        """Memory of one block: one slot's worth of KV in each of the group_size tensors (in those
        of `layers`' slots only, for a pipeline stage that holds those layers)."""
        num_slots = self.group_size if layers is None else len(self.slots(layers))
        spec = self.groups[self.pool_groups()[0]].spec
        if isinstance(spec, RecurrentStateSpec):
            return num_slots * spec.state_elements * STATE_BYTES
        return int(num_slots * token_bytes(spec, dtype_bytes, kv_cache_dtype) * block_size)

    def slots(self, layers: range) -> list[int]:
        """The pool tensors `layers` keep their KV in (a layer sharing another's KV, its target's;
        a hybrid's state layers are not in the block pool)."""
        return sorted({self.places[i][1] for i in layers if i not in self.state_layers})


def kv_layout(specs: list[KVCacheSpec]) -> KVLayout:
    owners: dict[KVCacheSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        if isinstance(spec, SharedKVSpec):
            if not 0 <= spec.target_layer < i or isinstance(specs[spec.target_layer], SharedKVSpec):
                raise ValueError(f"layer {i} shares the KV of layer {spec.target_layer}, which is not an "
                                 "earlier layer with KV of its own")
        else:
            owners.setdefault(spec, []).append(i)
    if not owners:
        raise ValueError("no layer keeps KV of its own")
    if len({isinstance(s, MLAAttentionSpec) for s in owners}) > 1:
        raise ValueError("latent (MLA) and K/V layers cannot share one block pool")
    states = {spec: layers for spec, layers in owners.items() if isinstance(spec, RecurrentStateSpec)}
    pooled = {spec: layers for spec, layers in owners.items() if spec not in states} or states
    sizes = {s.elements_per_token for s in pooled}
    if len(sizes) > 1:
        raise ValueError(f"layers keep different KV sizes per token ({sorted(sizes)} numbers): one block pool "
                         "cannot serve them")
    size = math.gcd(*(len(layers) for layers in pooled.values()))
    # A hybrid's states are slots of their own (module docstring): one group per state spec, whole.
    apart = tuple(KVGroup(spec, tuple(layers)) for spec, layers in states.items() if spec not in pooled)
    groups = tuple(KVGroup(spec, tuple(layers[k:k + size]))
                   for spec, layers in pooled.items() for k in range(0, len(layers), size)) + apart
    places: list[tuple[int, int] | None] = [None] * len(specs)
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layers):
            places[layer] = (g, j)
    for i, spec in enumerate(specs):
        if isinstance(spec, SharedKVSpec):
            places[i] = places[spec.target_layer]
    return KVLayout(groups, tuple(places))
