"""The Mamba-2 mixer, with its recurrent state passed in and handed back.

A Mamba-2 layer keeps no KV cache: what it remembers of a request is a fixed-size `MambaState`,
whatever the request's length. The mixer never keeps that state itself; every call takes the
states it starts from and returns the new ones, so the engine can hold one per request (a slot,
swapped or dropped on preemption) and a chunked prefill is several calls, each from the state the
previous one returned.

One call, for T tokens:

    in_proj(h) → z | xBC | dt              z: the gate, xBC: x, B and C before the convolution
    xBC → causal depthwise conv1d (kernel K, over the request's previous K-1 inputs too) → SiLU
    dt → softplus(dt + dt_bias), clamped to time_step_limit          (a step size per head)
    SSD scan:  h_t = exp(dt_t A) h_{t-1} + dt_t x_t ⊗ B_t,   y_t = h_t C_t + D x_t
    y · SiLU(z) → RMS-normalised per group → out_proj

A is one negative scalar per head (-exp(A_log)); heads in a group share B and C (n_groups groups).

The state (HF's `Cache` layout for one request, so states move between the two unchanged):
- `conv` [conv_dim, K]: the last K inputs of the convolution (x, B, C before it), oldest first.
  The next token reads only the last K-1 of them; the oldest is kept because HF's cache keeps it.
  Model dtype: it holds inputs, it accumulates nothing.
- `ssm` [heads, head_dim, d_state]: h, float32 whatever the model dtype (it sums every token).

The scan runs in float32 in two forms with the same result:
- `ssd_chunked`, the Mamba-2 paper's state-space duality: within a chunk of L tokens the outputs are
  a masked, decayed (C B^T) product, quadratic in L but all matrix products; across chunks the
  state is carried, one step per chunk. What prefill runs.
- `ssd_sequential`, the recurrence above token by token: the reference the chunked form is tested
  against, and one step of it (batched over requests) is decode.

dt is clamped in decode as in prefill (transformers' cached decode step skips the clamp its prefill
applies), so a request's state does not depend on how its tokens were split into calls; with the
default limit (0, inf) the clamp does nothing.

Not sharded: in_proj's output interleaves per-head (z, x, dt) and per-group (B, C) parts, and the
gated norm normalises over groups, so a rank's share is not a slice a linear layer of the seam keeps;
the model refuses tensor_parallel_size > 1 (kvflow.model.models.mamba2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.model.arch_config import FAMILY_DEFAULTS
from kvflow.model.layers.linear import ReplicatedLinear
from kvflow.quant.base import QuantizationConfig

# (x [T, H, P], dt [T, H], A [H], B [T, G, N], C [T, G, N], state [H, P, N]) → (y [T, H, P], state)
Scan = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# Mamba2Config's defaults (transformers), for fields a config.json leaves out.
_DEFAULTS: Mapping = FAMILY_DEFAULTS["mamba2"]


@dataclass(frozen=True)
class MixerConfig:
    """One mixer's sizes and constants, read from an HF Mamba2 config.json dict."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    eps: float
    use_bias: bool
    use_conv_bias: bool
    dt_min: float
    dt_max: float

    @classmethod
    def from_hf(cls, config: Mapping) -> MixerConfig:
        cfg = {**_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        for key in ("hidden_size", "num_heads"):
            if key not in cfg:
                raise ValueError(f"config.json is missing {key!r}")
        if cfg["hidden_act"] != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported by the Mamba-2 mixer (only 'silu')")
        dt_min, dt_max = _time_step_limit(cfg["time_step_limit"])
        mixer = cls(hidden_size=int(cfg["hidden_size"]), num_heads=int(cfg["num_heads"]),
                    head_dim=int(cfg["head_dim"]), state_size=int(cfg["state_size"]), n_groups=int(cfg["n_groups"]),
                    conv_kernel=int(cfg["conv_kernel"]), chunk_size=int(cfg["chunk_size"]),
                    eps=float(cfg["layer_norm_epsilon"]), use_bias=bool(cfg["use_bias"]),
                    use_conv_bias=bool(cfg["use_conv_bias"]), dt_min=dt_min, dt_max=dt_max)
        mixer._check(int(cfg["hidden_size"]) * int(cfg["expand"]))
        return mixer

    def _check(self, expanded: int) -> None:
        if expanded != self.inner_size:
            raise ValueError(f"hidden_size x expand ({expanded}) must equal num_heads x head_dim ({self.inner_size})")
        if self.n_groups < 1 or self.num_heads % self.n_groups:
            raise ValueError(f"n_groups ({self.n_groups}) must divide num_heads ({self.num_heads})")
        for key in ("head_dim", "state_size", "conv_kernel", "chunk_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be at least 1; got {getattr(self, key)}")

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the convolution mixes: x, B and C."""
        return self.inner_size + 2 * self.n_groups * self.state_size


def _time_step_limit(limit) -> tuple[float, float]:
    if not isinstance(limit, (list, tuple)) or len(limit) != 2:
        raise ValueError(f"time_step_limit must be [min, max]; got {limit!r}")
    try:
        low, high = (_json_float(bound) for bound in limit)
    except (TypeError, ValueError):
        raise ValueError(f"time_step_limit must be two numbers; got {limit!r}") from None
    if not 0.0 <= low <= high:
        raise ValueError(f"time_step_limit must satisfy 0 <= min <= max; got {limit!r}")
    return low, high


def _json_float(value) -> float:
    """A number from config.json; transformers 5 writes infinity as {"__float__": "Infinity"}
    (JSON has no literal for it)."""
    if isinstance(value, Mapping) and set(value) == {"__float__"}:
        value = value["__float__"]
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(value)
    return float(value)


@dataclass(frozen=True)
class MambaState:
    """One request's recurrent state in one mixer layer (layout in the module docstring)."""

    conv: torch.Tensor  # [conv_dim, conv_kernel], model dtype
    ssm: torch.Tensor  # [num_heads, head_dim, state_size], float32

    @classmethod
    def zeros(cls, cfg: MixerConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> MambaState:
        """A request's state before its first token."""
        return cls(torch.zeros(cfg.conv_dim, cfg.conv_kernel, dtype=dtype, device=device),
                   torch.zeros(cfg.num_heads, cfg.head_dim, cfg.state_size, dtype=torch.float32, device=device))


def ssd_sequential(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan token by token (a `Scan`): the float32 reference of `ssd_chunked`."""
    heads = x.shape[1]
    B, C = _per_head(B, heads), _per_head(C, heads)
    ys = []
    for t in range(x.shape[0]):
        y, state = recurrent_step(state, x[t], dt[t], A, B[t], C[t])
        ys.append(y)
    return torch.stack(ys), state


def recurrent_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                   B: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence, over any leading (request) dimensions: state [..., H, P, N],
    x [..., H, P], dt [..., H], B and C per head [..., H, N] → (y [..., H, P], new state)."""
    decay = torch.exp(dt * A)[..., None, None]
    state = state * decay + (dt[..., None] * x)[..., None] * B[..., None, :]
    return (state @ C[..., None]).squeeze(-1), state


def recurrent_step_(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                    B: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`recurrent_step` with `state` updated in place: a decode's states, gathered for the step, are
    read and written once (the out-of-place form passes over them four times: at batch 64 of a
    130M model, 48 MiB of state a layer)."""
    state.mul_(torch.exp(dt * A)[..., None, None]).addcmul_((dt[..., None] * x)[..., None], B[..., None, :])
    return (state @ C[..., None]).squeeze(-1), state


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan as the state-space dual (a `Scan` once `chunk_size` is bound): chunks of
    `chunk_size` tokens (the last may be shorter; nothing is padded), each computed whole from the
    state the previous one ended in."""
    ys = []
    for start in range(0, x.shape[0], chunk_size):
        chunk = slice(start, start + chunk_size)
        y, state = _ssd_chunk(x[chunk], dt[chunk], A, B[chunk], C[chunk], state)
        ys.append(y)
    return torch.cat(ys), state


def _ssd_chunk(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of L tokens from `state` [H, P, N]. With a_t = dt_t A (the log of step t's decay):
        y_t = sum_{s<=t} exp(a_{s+1} + ... + a_t) (C_t . B_s) dt_s x_s + exp(a_0 + ... + a_t) state C_t
    the first term a lower-triangular [L, L] product per head, the second the carried state's share;
    the chunk's final state is the same sums taken at t = L-1, with x_s ⊗ B_s for C_t."""
    length, heads, _ = x.shape
    groups = B.shape[1]
    log_decay = (dt * A).t()  # [H, L]
    between = _segment_sums(log_decay)  # [H, L, L]: a_{s+1} + ... + a_t, -inf where s > t
    scores = C.transpose(0, 1) @ B.permute(1, 2, 0)  # [G, L, L]: C_t . B_s, once per group
    weights = between.exp().view(groups, heads // groups, length, length) * scores[:, None]
    inputs = (dt[..., None] * x).transpose(0, 1)  # [H, L, P]: dt_s x_s
    y = weights.view(heads, length, length) @ inputs
    since_start = log_decay.cumsum(-1)  # [H, L]: a_0 + ... + a_t
    C_heads, B_heads = _per_head(C, heads).transpose(0, 1), _per_head(B, heads).transpose(0, 1)  # [H, L, N]
    y = y + (C_heads @ state.transpose(1, 2)) * since_start.exp()[..., None]
    to_end = between[:, -1, :].exp()[..., None]  # [H, L, 1]: decay from after s to the chunk's end
    state = state * since_start[:, -1].exp()[:, None, None] + (inputs * to_end).transpose(1, 2) @ B_heads
    return y.transpose(0, 1), state


def _segment_sums(log_decay: torch.Tensor) -> torch.Tensor:
    """[H, L] → [H, L, L]: entry (t, s) is a_{s+1} + ... + a_t (0 on the diagonal, -inf above it),
    as a difference of running sums taken in float64: in float32 the difference would lose the low
    bits of a short segment's sum to the large total before it, and a short segment's decay is the
    one that weighs most."""
    length = log_decay.shape[-1]
    running = log_decay.double().cumsum(-1)
    sums = (running[:, :, None] - running[:, None, :]).to(log_decay.dtype)
    on_or_below = torch.ones(length, length, dtype=torch.bool, device=log_decay.device).tril()
    return sums.masked_fill(~on_or_below, -math.inf)


def _per_head(groups: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., G, N] → [..., H, N]: head h reads group h // (H / G), as in HF's layout."""
    return groups.repeat_interleave(heads // groups.shape[-2], dim=-2)


class CausalDepthwiseConv(nn.Module):
    """conv1d over each channel's own past K inputs (HF's nn.Conv1d weight layout, [channels, 1, K]),
    then SiLU; the previous K inputs come from the state, so a chunk's first tokens see the end of
    the previous chunk exactly as a single call would."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None

    def prefill(self, xbc: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """xbc [T, channels], conv_state [channels, K] → (outputs [T, channels], new state)."""
        kernel = self.weight.shape[-1]
        window = torch.cat([conv_state.to(xbc.dtype), xbc.t()], dim=1)  # [channels, K + T]
        # K + T inputs give T + 1 outputs; the first ends at the state's last input, a token already done.
        out = F.conv1d(window[None], self.weight, self.bias, groups=window.shape[0])[0, :, 1:]
        return F.silu(out).t(), window[:, -kernel:]

    def step(self, xbc: torch.Tensor, conv_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per request: xbc [R, channels], conv_states [R, channels, K] → (outputs, new states)."""
        window = torch.cat([conv_states[:, :, 1:].to(xbc.dtype), xbc[:, :, None]], dim=2)
        out = (window * self.weight[:, 0]).sum(-1)
        return F.silu(out if self.bias is None else out + self.bias), window


class GatedRMSNorm(nn.Module):
    """Mamba-2's output norm: y · SiLU(z), RMS-normalised over groups of `group_size` channels (each
    group of heads that shares B and C on its own), times the weight; in float32, rounded once to
    the model dtype. Not kvflow's RMSNorm: it gates first and normalises per group."""

    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gated = (y.float() * F.silu(z.float())).unflatten(-1, (-1, self.group_size))
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed.flatten(-2)).to(z.dtype)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 mixer (HF's parameter names: in_proj, conv1d, dt_bias, A_log, D, norm, out_proj).
    A_log, D and dt_bias stay float32 in any model dtype: A = -exp(A_log) sets every step's decay,
    which bf16 would shift by up to 0.4 %."""

    def __init__(self, cfg: MixerConfig, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.cfg = cfg
        heads = cfg.num_heads
        self.in_proj = ReplicatedLinear(cfg.hidden_size, cfg.inner_size + cfg.conv_dim + heads, cfg.use_bias,
                                        quant_config, f"{prefix}.in_proj")
        self.conv1d = CausalDepthwiseConv(cfg.conv_dim, cfg.conv_kernel, cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(heads, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(heads, dtype=torch.float32), requires_grad=False)
        self.D = nn.Parameter(torch.empty(heads, dtype=torch.float32), requires_grad=False)
        self.norm = GatedRMSNorm(cfg.inner_size, cfg.inner_size // cfg.n_groups, cfg.eps)
        self.out_proj = ReplicatedLinear(cfg.inner_size, cfg.hidden_size, cfg.use_bias, quant_config,
                                         f"{prefix}.out_proj")
        self.chunked_scan: Scan = partial(ssd_chunked, chunk_size=cfg.chunk_size)

    def forward(self, hidden: torch.Tensor, states: Sequence[MambaState],
                token_counts: Sequence[int]) -> tuple[torch.Tensor, list[MambaState]]:
        """A flat batch: hidden [sum(token_counts), hidden_size], request r's `token_counts[r]` rows
        in order, each request from `states[r]`. In and out projections run once over all rows;
        one-token requests scan together (as `decode`), longer ones one by one (as `prefill`).
        Returns (outputs, each request's new state)."""
        z, xbc, dt = self._project(hidden)
        y = torch.empty(hidden.shape[0], self.cfg.inner_size, dtype=torch.float32, device=hidden.device)
        new_states = list(states)
        starts = [0, *accumulate(token_counts)]
        single = [r for r, n in enumerate(token_counts) if n == 1]
        if single:
            rows = torch.tensor([starts[r] for r in single], device=hidden.device)
            y[rows], stepped = self._decode_scan(xbc[rows], dt[rows], [states[r] for r in single])
            for r, state in zip(single, stepped):
                new_states[r] = state
        for r, n in enumerate(token_counts):
            if n > 1:
                rows = slice(starts[r], starts[r] + n)
                y[rows], new_states[r] = self._prefill_scan(xbc[rows], dt[rows], states[r], self.chunked_scan)
        return self._output(y, z), new_states

    def prefill(self, hidden: torch.Tensor, state: MambaState,
                scan: Scan | None = None) -> tuple[torch.Tensor, MambaState]:
        """T tokens of one request (hidden [T, hidden_size]) from `state` → (outputs, the state
        after them); `scan` the chunked SSD by default (`ssd_sequential` is the reference)."""
        z, xbc, dt = self._project(hidden)
        y, state = self._prefill_scan(xbc, dt, state, scan or self.chunked_scan)
        return self._output(y, z), state

    def decode(self, hidden: torch.Tensor, states: Sequence[MambaState]) -> tuple[torch.Tensor, list[MambaState]]:
        """One token of each of R requests (hidden [R, hidden_size]), request r from `states[r]`."""
        z, xbc, dt = self._project(hidden)
        y, states = self._decode_scan(xbc, dt, states)
        return self._output(y, z), states

    def decode_stacked(self, hidden: torch.Tensor, conv: torch.Tensor,
                       ssm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`decode` with the R requests' states stacked (conv [R, conv_dim, K], ssm [R, heads,
        head_dim, state_size] float32, updated in place: the caller's gathered copy): a decode
        step's states as the engine gathers them, one tensor a layer, with no state objects per
        request. Returns (outputs, conv, ssm)."""
        z, xbc, dt = self._project(hidden)
        y, conv, ssm = self._stacked_step(xbc, dt, conv, ssm)
        return self._output(y, z), conv, ssm

    def check_state(self, state: MambaState, what: str) -> None:
        """A ValueError naming `what` unless `state` is a state of this mixer."""
        cfg = self.cfg
        expected = {"conv": (cfg.conv_dim, cfg.conv_kernel), "ssm": (cfg.num_heads, cfg.head_dim, cfg.state_size)}
        if not isinstance(state, MambaState):
            raise ValueError(f"{what} must be a MambaState; got {type(state).__name__}")
        for name, shape in expected.items():
            tensor = getattr(state, name)
            if tuple(tensor.shape) != shape or not tensor.is_floating_point():
                raise ValueError(f"{what}.{name} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}; "
                                 f"expected a float tensor of shape {shape}")

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        return self.in_proj(hidden).split([cfg.inner_size, cfg.conv_dim, cfg.num_heads], dim=-1)

    def _prefill_scan(self, xbc: torch.Tensor, dt: torch.Tensor, state: MambaState,
                      scan: Scan) -> tuple[torch.Tensor, MambaState]:
        xbc, conv = self.conv1d.prefill(xbc, state.conv)
        x, B, C = self._split_xbc(xbc)
        y, ssm = scan(x, self._step_sizes(dt), self._A(), B, C, state.ssm.float())
        return self._skip(y, x).flatten(-2), MambaState(conv.to(state.conv.dtype), ssm)

    def _decode_scan(self, xbc: torch.Tensor, dt: torch.Tensor,
                     states: Sequence[MambaState]) -> tuple[torch.Tensor, list[MambaState]]:
        y, conv, ssm = self._stacked_step(xbc, dt, torch.stack([s.conv for s in states]),
                                          torch.stack([s.ssm.float() for s in states]))
        return y, [MambaState(c, s) for c, s in zip(conv.unbind(0), ssm.unbind(0))]

    def _stacked_step(self, xbc: torch.Tensor, dt: torch.Tensor, conv_states: torch.Tensor,
                      ssm_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`ssm_states` (float32) is updated in place: the callers' own stacked copies."""
        xbc, conv = self.conv1d.step(xbc, conv_states)
        x, B, C = self._split_xbc(xbc)
        heads = self.cfg.num_heads
        y, ssm = recurrent_step_(ssm_states, x, self._step_sizes(dt), self._A(), _per_head(B, heads),
                                 _per_head(C, heads))
        return self._skip(y, x).flatten(-2), conv.to(conv_states.dtype), ssm

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved [rows, conv_dim] → float32 x [rows, H, P], B and C [rows, G, N]."""
        cfg = self.cfg
        group_size = cfg.n_groups * cfg.state_size
        x, B, C = xbc.float().split([cfg.inner_size, group_size, group_size], dim=-1)
        return (x.unflatten(-1, (cfg.num_heads, cfg.head_dim)), B.unflatten(-1, (cfg.n_groups, cfg.state_size)),
                C.unflatten(-1, (cfg.n_groups, cfg.state_size)))

    def _step_sizes(self, dt: torch.Tensor) -> torch.Tensor:
        """Each token's step per head: softplus(dt + dt_bias) within time_step_limit."""
        return F.softplus(dt.float() + self.dt_bias).clamp(self.cfg.dt_min, self.cfg.dt_max)

    def _A(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())

    def _skip(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y + self.D[:, None] * x

    def _output(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.norm(y, z))
