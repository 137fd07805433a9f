"""LFM2's gated short convolution, with each request's state passed in and updated where it lies.

One call, for a flat batch of requests' rows h:

    in_proj(h) → B | C | x                  (hidden_size channels each, in that order: HF's layout)
    B·x → depthwise causal conv1d of kernel L (each channel over its own last L inputs; no activation)
    C · that → out_proj

What a request remembers is the convolution's last L-1 inputs per channel (B·x), oldest first:
all the next token reads, so the state is [channels, L-1] (kv_cache_spec.ShortConvStateSpec),
with no scan and nothing summed. The engine keeps it float32 in the request's state slot, as
every state (`mamba2.PooledStates` gathers a step's slots, zeroes a fresh request's and writes
them back); the convolution runs in the model's dtype, as HF's does.

Not sharded: tensor parallelism would split the channels (in_proj by columns, out_proj by rows,
the convolution per channel), but a rank's state slots would then hold its channels only, which
the per-rank layout does not size yet; the model refuses tensor_parallel_size > 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.model.layers.linear import ReplicatedLinear
from kvflow.quant.base import QuantizationConfig


class CausalShortConv(nn.Module):
    """conv1d over each channel's own last `kernel` inputs (HF's nn.Conv1d weight, [channels, 1,
    kernel]); the kernel - 1 inputs before a call's first row come from the state, so a prompt
    split into chunks sees across each cut exactly what one call would."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None

    def prefill(self, inputs: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's rows: inputs [T, channels], state [channels, kernel - 1] → (outputs [T,
        channels], the state after them: the last kernel - 1 of state and inputs together)."""
        window = torch.cat([state.to(inputs.dtype), inputs.t()], dim=1)  # [channels, kernel - 1 + T]
        out = F.conv1d(window[None], self.weight, self.bias, groups=window.shape[0])[0]
        return out.t(), window[:, window.shape[1] - state.shape[1]:]

    def step(self, inputs: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One row per request: inputs [R, channels], states [R, channels, kernel - 1] → (outputs
        [R, channels], the new states)."""
        window = torch.cat([states.to(inputs.dtype), inputs[:, :, None]], dim=2)  # [R, channels, kernel]
        out = (window * self.weight[:, 0]).sum(-1)
        return out if self.bias is None else out + self.bias, window[:, :, 1:]


class ShortConv(nn.Module):
    """One gated short-convolution layer (HF's names: in_proj, conv, out_proj); both projections
    are the linear seam's, so quantization applies to them."""

    def __init__(self, hidden_size: int, kernel: int, bias: bool, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.hidden_size, self.kernel = hidden_size, kernel
        self.in_proj = ReplicatedLinear(hidden_size, 3 * hidden_size, bias, quant_config, f"{prefix}.in_proj")
        self.conv = CausalShortConv(hidden_size, kernel, bias)
        self.out_proj = ReplicatedLinear(hidden_size, hidden_size, bias, quant_config, f"{prefix}.out_proj")

    def state_view(self, rows: torch.Tensor) -> torch.Tensor:
        """State rows [R, channels * (kernel - 1)] as [R, channels, kernel - 1] (a view: writes
        into it are writes into the rows)."""
        return rows.view(rows.shape[0], self.hidden_size, self.kernel - 1)

    def forward(self, hidden: torch.Tensor, states: torch.Tensor, query_lens: Sequence[int]) -> torch.Tensor:
        """A flat batch: hidden [sum(query_lens), hidden_size], request r's `query_lens[r]` rows in
        order, from `states[r]` ([R, channels, kernel - 1], updated in place to each request's
        state after its rows). Projections run once over all rows; a step of one row per request
        convolves them stacked, a step with longer chunks request by request."""
        gate_in, gate_out, x = self.in_proj(hidden).chunk(3, dim=-1)
        inputs = gate_in * x
        if all(n == 1 for n in query_lens):
            convolved, states[:] = self.conv.step(inputs, states)
        else:
            starts = list(accumulate(query_lens, initial=0))
            pieces = []
            for r, (start, end) in enumerate(zip(starts, starts[1:])):
                out, states[r] = self.conv.prefill(inputs[start:end], states[r])
                pieces.append(out)
            convolved = torch.cat(pieces)
        return self.out_proj(gate_out * convolved)
