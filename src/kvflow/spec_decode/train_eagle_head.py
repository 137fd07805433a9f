"""The EAGLE-1 head as a plain torch module to train, and the checkpoint it is saved as.

The checkpoint is the format yuhuili/EAGLE-* publish and vLLM's EAGLE-1 loader
(`EagleLlamaForCausalLM`) reads: a directory with a Llama `config.json` of the target's dimensions
and one layer, and `model.safetensors` with

    fc.weight                                   [H, 2H]   (no bias: vLLM's fc has none and skips
                                                            tensors it does not know, so a trained
                                                            bias would be dropped without a word)
    layers.0.self_attn.{q,k,v,o}_proj.weight
    layers.0.mlp.{gate,up,down}_proj.weight
    layers.0.post_attention_layernorm.weight

and nothing else: layer 0 has no input norm, and the embedding and the LM head are the target's.

The head's math for the pair at position p, whose inputs are the token at p + 1 and the target's
feature at p (its final hidden state after the final norm, what its LM head reads):

    x = fc(cat(embed(token[p+1]), feature[p]))
    a = o_proj(causal attention of q, k, v = proj(x), RoPE at position p)
    r = x + a
    h = r + mlp(post_attention_layernorm(r))          (h is not normed)
    logits of token[p+2] = target_lm_head(h)

Training keeps the target's embedding, LM head and RoPE tables as frozen buffers, outside the
state dict: the saved tensors are exactly the ones above.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from kvflow.model.layers.reference import Rope, torch_rms_norm, torch_rotary

HEAD_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# Keys of the target's config that say something else than a one-layer Llama head of its shape.
_TARGET_ONLY_KEYS = ("quantization_config", "auto_map", "layer_types", "sliding_window", "use_sliding_window",
                     "max_window_layers")


@dataclass(frozen=True)
class HeadShape:
    """The target's dimensions, which the head shares."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float

    @classmethod
    def from_arch(cls, arch) -> HeadShape:
        """From a `kvflow.model.arch_config.ArchConfig`."""
        return cls(arch.hidden_size, arch.intermediate_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                   arch.rms_norm_eps)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the checkpoint, by name."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.num_heads * self.head_dim, \
            self.num_kv_heads * self.head_dim
        layer = "layers.0."
        return {
            "fc.weight": (h, 2 * h),
            f"{layer}self_attn.q_proj.weight": (q, h), f"{layer}self_attn.k_proj.weight": (kv, h),
            f"{layer}self_attn.v_proj.weight": (kv, h), f"{layer}self_attn.o_proj.weight": (h, q),
            f"{layer}mlp.gate_proj.weight": (i, h), f"{layer}mlp.up_proj.weight": (i, h),
            f"{layer}mlp.down_proj.weight": (h, i),
            f"{layer}post_attention_layernorm.weight": (h,),
        }


@dataclass(frozen=True)
class FrozenTarget:
    """What the head borrows from the target, float32: the embedding and LM head rows [vocab, H]
    (one tensor when they are tied) and the RoPE tables [positions, head_dim / 2]."""

    embed: torch.Tensor
    lm_head: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class _Norm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class _Attention(nn.Module):
    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)


class _Layer(nn.Module):
    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.self_attn = _Attention(s)
        self.mlp = _MLP(s)
        self.post_attention_layernorm = _Norm(s.hidden_size, s.rms_norm_eps)


class EagleHead(nn.Module):
    """The head, float32, on batches of sequences [B, L] (every sequence from position 0): full
    causal attention over each, as training wants, where serving runs it a token at a time over a KV
    cache. Its parameter names are the checkpoint's tensor names."""

    def __init__(self, shape: HeadShape, target: FrozenTarget) -> None:
        super().__init__()
        self.shape = shape
        self.fc = nn.Linear(2 * shape.hidden_size, shape.hidden_size, bias=False)
        self.layers = nn.ModuleList([_Layer(shape)])
        for name, tensor in (("embed", target.embed), ("lm_head", target.lm_head), ("cos", target.cos),
                             ("sin", target.sin)):
            # A copy: the target's tensors were made in inference mode, which autograd cannot save.
            self.register_buffer(name, tensor.float().clone(), persistent=False)

    def forward(self, next_tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """h [B, L, H] of the pairs (next_tokens[b, p], features[b, p]) at positions p = 0..L-1."""
        layer = self.layers[0]
        x = self.fc(torch.cat((self.embed[next_tokens], features), dim=-1))
        attended = layer.self_attn.o_proj(self._attention(layer.self_attn, x))
        normed, residual = torch_rms_norm(attended, layer.post_attention_layernorm.weight,
                                          layer.post_attention_layernorm.eps, x)
        mlp = layer.mlp
        return residual + mlp.down_proj(F.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed))

    def _attention(self, attn: _Attention, x: torch.Tensor) -> torch.Tensor:
        s = self.shape
        batch, length, _ = x.shape
        rope = Rope(torch.arange(length, device=x.device), self.cos, self.sin, custom_ops=False)
        q = torch_rotary(attn.q_proj(x).unflatten(-1, (s.num_heads, s.head_dim)), rope)
        k = torch_rotary(attn.k_proj(x).unflatten(-1, (s.num_kv_heads, s.head_dim)), rope)
        v = attn.v_proj(x).unflatten(-1, (s.num_kv_heads, s.head_dim))
        group = s.num_heads // s.num_kv_heads
        k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             scale=s.head_dim ** -0.5)
        return out.transpose(1, 2).reshape(batch, length, s.num_heads * s.head_dim)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The target's LM head on h (no final norm: the head's output is read as it is)."""
        return h @ self.lm_head.T

    @torch.no_grad()
    def init_from_target(self, last_layer: dict[str, torch.Tensor]) -> None:
        """fc = [0 | I]; the decoder layer from the target's last layer (HF-named float tensors, as
        `tensor_shapes` names them) but for its two output projections, o_proj and down_proj, zero.

        So the head starts as h = feature[p] exactly: its logits are the target's own at p, a sane
        guess of the token after next, where a random head's are noise. Zero output projections
        (the residual branches' last matrices) keep that identity whatever the layer computes, and
        the target's layer's first matrices only have to be steered: they already read vectors of
        the scale its norms produce. The target's last layer as it is would not do: its outputs are
        sized for the target's residual stream, which is far larger than a normed feature, and
        they would swamp the feature at the start. The embedding half of fc learns from zero what
        the next token adds."""
        h = self.shape.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, h:].copy_(torch.eye(h))
        params = dict(self.named_parameters())
        for name, tensor in last_layer.items():
            params[name].copy_(tensor)
        layer = self.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()


def eagle_config(target_hf_config: dict, arch) -> dict:
    """The head's config.json: the target's (its vocabulary, token ids and context as they are) as
    a one-layer Llama of the target's dimensions (`arch`: its `ArchConfig`), RoPE spelled as
    `rope_theta` / `rope_scaling` as well, which older readers of Llama configs take."""
    shape = HeadShape.from_arch(arch)
    config = {k: v for k, v in target_hf_config.items() if k not in _TARGET_ONLY_KEYS}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
                  hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                  num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                  head_dim=shape.head_dim, rms_norm_eps=shape.rms_norm_eps, hidden_act="silu",
                  attention_bias=False, mlp_bias=False, torch_dtype="float32", rope_theta=arch.rope_theta,
                  rope_scaling=arch.rope_scaling, vocab_size=arch.vocab_size)
    return config


def save_head(head: EagleHead, config: dict, out: Path, metadata: dict[str, str]) -> None:
    """config.json and model.safetensors (float32, so that a resumed run continues from the very
    numbers it stopped at), each written whole before it replaces the old one."""
    tensors = {name: p.detach().contiguous() for name, p in head.named_parameters()}
    _replace(out / HEAD_FILE, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    _replace(out / CONFIG_FILE, lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n"))


def load_head_tensors(path: Path, shape: HeadShape) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, refused (naming the tensor) unless they are exactly the format's."""
    tensors = load_file(str(path))
    expected = shape.tensor_shapes()
    if set(tensors) != set(expected):
        raise ValueError(f"{path}: tensors {sorted(set(tensors) ^ set(expected))} differ from an EAGLE head's "
                         f"({', '.join(expected)})")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, expected {expected[name]}")
    return tensors


def _replace(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    tmp.replace(path)
