"""What one step runs: a flat list of chunks, one per scheduled request.

This is the only thing the worker learns about requests: token ids to compute, where they sit,
which blocks hold the request's KV, and how to sample if the chunk reaches the request's end.

With speculative decoding a chunk that reaches the end may carry proposed tokens after the known
ones: the worker verifies them in the same forward pass and returns every token it accepted (one
more than the accepted proposals). A chunk may also ask the worker to propose tokens for the next
step; the slots those proposals will occupy are already reserved in `block_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.core.kv_connector import KVConnectorMetadata
from kvflow.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from kvflow.lora.request import LoRARequest


@dataclass(frozen=True)
class ScheduledChunk:
    request_id: str
    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # position of token_ids[0] == tokens computed before it
    block_ids: tuple[list[int], ...]  # one block table per KV group
    sample: bool  # the chunk reaches the last known token: produce the next one
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # for penalties and min_tokens; read-only for the worker
    eos_token_ids: frozenset[int]
    lora_request: LoRARequest | None = None  # the adapter its rows run with
    num_spec_tokens: int = 0  # the last this-many of token_ids are proposals to verify (then sample is True)
    num_lookahead_tokens: int = 0  # tokens to propose after sampling, for the next step
    # Positions whose KV a budget evicted (core/kv_eviction.py): token_ids[0]'s KV index is
    # start_pos - this, its rotary position start_pos.
    num_evicted_tokens: int = 0
    images: tuple = ()  # the request's PromptImages (core.request), whose rows replace its `<image>` tokens'

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """A decode or a verification: one new token to sample, after any proposals (no prompt tokens)."""
        return self.sample and self.num_tokens == 1 + self.num_spec_tokens

    @property
    def spec_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_spec_tokens:] if self.num_spec_tokens else []


@dataclass
class StepGrammar:
    """The grammar masks of one step, by request (structured output): rows first_row[r] ..
    first_row[r] + k are request r's masks after its output and after each of the k proposals it
    verifies. The engine fills them; the worker applies them to the logits it samples from."""

    bitmask: torch.Tensor  # [rows, ceil(vocab / 32)] int32 on the CPU; bit set = allowed
    first_row: dict[str, int]


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Requests that ended since the last step: the worker drops their per-request state.
    finished_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: list[str] = field(default_factory=list)
    # (device block, host block) copies, done before the forward pass: swap-outs, then swap-ins.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # (source, destination) device block copies: copy-on-write of cached blocks, done after the
    # swap-outs and before the swap-ins.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Blocks the KV connector loads before the forward pass and saves after it (None: no connector).
    kv_connector_metadata: KVConnectorMetadata | None = None
    # The grammar masks of the sampling rows whose requests have one, filled by the engine after
    # scheduling (None: no row has a grammar).
    grammar: StepGrammar | None = None
    # LoRA adapters the unfinished requests use (a worker's host cache keeps them), with LoRA on.
    adapters_in_use: frozenset[int] = frozenset()

    num_batched_tokens: int = 0

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks.append(chunk)
        self.num_batched_tokens += chunk.num_tokens

    def drop(self, request_id: str) -> None:
        """Take back a request's chunk (it was preempted later in the same step)."""
        kept = [c for c in self.chunks if c.request_id != request_id]
        self.num_batched_tokens -= sum(c.num_tokens for c in self.chunks) - sum(c.num_tokens for c in kept)
        self.chunks = kept

    @property
    def empty(self) -> bool:
        return not (self.chunks or self.swap_out or self.swap_in or self.block_copies)
