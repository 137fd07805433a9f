"""The step message sent to worker processes: what changed since the last step, not everything.

A `SchedulerOutput` names each scheduled request with its whole prompt, outputs and block tables:
free to pass within one process, O(context) bytes per step across processes. So the executor
encodes it (`StepEncoder`) into a `StepMessage`:

- `NewRequestData` the first time a worker sees a request: prompt, outputs so far, sampling
  parameters, block tables;
- `CachedRequestData` afterwards: where the chunk starts and how long it is, the output tokens
  sampled since (one per decode step), blocks appended to each table and entries a sliding window
  gave back.

Both kinds carry the proposals a chunk verifies (speculative decoding) and how many tokens to
propose after it: every rank verifies and proposes, so that a drafter on the model's collectives
(layer skip) runs on every rank, and every rank samples the same tokens. The step's grammar masks
and the adapters in use travel whole.

Each worker rebuilds the same `SchedulerOutput` from the per-request state it keeps
(`StepDecoder`). A request whose table changed in any other way (recomputed after preemption,
swapped back in, a copy-on-write) is simply sent as new again. Outputs are append-only; a
request whose outputs shrank is also sent again. Both sides drop a request when the scheduler
reports it finished or preempted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.core.kv_cache_manager import NULL_BLOCK
from kvflow.core.kv_connector import KVConnectorMetadata
from kvflow.core.sched_output import ScheduledChunk, SchedulerOutput, StepGrammar
from kvflow.lora.request import LoRARequest
from kvflow.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    block_ids: tuple[list[int], ...]
    start_pos: int
    num_tokens: int
    sample: bool
    lora_request: LoRARequest | None = None
    spec_token_ids: tuple[int, ...] = ()  # proposals verified after the chunk's known tokens
    num_lookahead_tokens: int = 0
    num_evicted_tokens: int = 0
    images: tuple = ()  # the prompt's images (core.request.PromptImage), sent once with the request


@dataclass(frozen=True)
class CachedRequestData:
    request_id: str
    start_pos: int
    num_tokens: int  # known tokens (the proposals come on top)
    sample: bool
    new_output_token_ids: list[int]
    new_block_ids: tuple[list[int], ...]  # per KV group, appended to its table
    nulled: tuple[tuple[int, ...], ...]  # per KV group, table entries now NULL_BLOCK
    spec_token_ids: tuple[int, ...] = ()
    num_lookahead_tokens: int = 0
    num_evicted_tokens: int = 0


@dataclass
class StepMessage:
    # In the scheduler's order: chunk i of the rebuilt SchedulerOutput is requests[i].
    requests: list[NewRequestData | CachedRequestData] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    grammar: StepGrammar | None = None
    adapters_in_use: frozenset[int] = frozenset()
    kv_connector_metadata: KVConnectorMetadata | None = None  # every rank moves its part of the blocks


@dataclass
class _Sent:
    """What the workers know of one request."""

    num_outputs: int
    tables: tuple[list[int], ...]  # copies, as sent


class StepEncoder:
    """Executor side: remembers what it sent, and sends only the difference."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, sched: SchedulerOutput) -> StepMessage:
        for request_id in (*sched.finished_request_ids, *sched.preempted_request_ids):
            self._sent.pop(request_id, None)
        msg = StepMessage(finished_request_ids=set(sched.finished_request_ids),
                          preempted_request_ids=list(sched.preempted_request_ids),
                          swap_out=sched.swap_out, swap_in=sched.swap_in, block_copies=sched.block_copies,
                          grammar=sched.grammar, adapters_in_use=sched.adapters_in_use,
                          kv_connector_metadata=sched.kv_connector_metadata)
        msg.requests = [self._encode_chunk(c) for c in sched.chunks]
        return msg

    def _encode_chunk(self, c: ScheduledChunk) -> NewRequestData | CachedRequestData:
        sent = self._sent.get(c.request_id)
        diff = None if sent is None else _table_diff(sent.tables, c.block_ids)
        known, spec = c.num_tokens - c.num_spec_tokens, tuple(c.spec_token_ids)
        if diff is None or len(c.output_token_ids) < sent.num_outputs:
            self._sent[c.request_id] = _Sent(len(c.output_token_ids), tuple(list(t) for t in c.block_ids))
            return NewRequestData(c.request_id, c.prompt_token_ids, list(c.output_token_ids), c.sampling_params,
                                  c.eos_token_ids, c.block_ids, c.start_pos, known, c.sample, c.lora_request,
                                  spec, c.num_lookahead_tokens, c.num_evicted_tokens, c.images)
        new_blocks, nulled = diff
        for table, blocks, gone in zip(sent.tables, new_blocks, nulled):
            table.extend(blocks)
            for i in gone:
                table[i] = NULL_BLOCK
        new_outputs = c.output_token_ids[sent.num_outputs:]
        sent.num_outputs = len(c.output_token_ids)
        return CachedRequestData(c.request_id, c.start_pos, known, c.sample, new_outputs, new_blocks, nulled, spec,
                                 c.num_lookahead_tokens, c.num_evicted_tokens)


def _table_diff(old: tuple[list[int], ...], new: tuple[list[int], ...]):
    """(blocks appended, entries nulled) per group, or None when `new` is not `old` grown at the
    end with some entries given back to NULL_BLOCK (by a sliding window)."""
    appended, nulled = [], []
    for before, after in zip(old, new, strict=True):
        if len(after) < len(before):
            return None
        head = after[:len(before)]
        gone: tuple[int, ...] = ()
        if head != before:  # one C-level comparison in the common case: nothing given back
            gone = tuple(i for i, (b, a) in enumerate(zip(before, head)) if a != b)
            if any(head[i] != NULL_BLOCK for i in gone):
                return None
        appended.append(after[len(before):])
        nulled.append(gone)
    return tuple(appended), tuple(nulled)


@dataclass
class _RequestState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    block_ids: tuple[list[int], ...]
    lora_request: LoRARequest | None
    images: tuple = ()


class StepDecoder:
    """Worker side: the per-request state the messages update, and the SchedulerOutput rebuilt
    from it."""

    def __init__(self) -> None:
        self.requests: dict[str, _RequestState] = {}

    def decode(self, msg: StepMessage) -> SchedulerOutput:
        for request_id in (*msg.finished_request_ids, *msg.preempted_request_ids):
            self.requests.pop(request_id, None)
        sched = SchedulerOutput(finished_request_ids=msg.finished_request_ids,
                                preempted_request_ids=msg.preempted_request_ids,
                                swap_out=msg.swap_out, swap_in=msg.swap_in, block_copies=msg.block_copies,
                                grammar=msg.grammar, adapters_in_use=msg.adapters_in_use,
                                kv_connector_metadata=msg.kv_connector_metadata)
        for data in msg.requests:
            sched.add(self._chunk(data))
        return sched

    def _chunk(self, d: NewRequestData | CachedRequestData) -> ScheduledChunk:
        if isinstance(d, NewRequestData):
            state = _RequestState(d.prompt_token_ids, list(d.output_token_ids), d.sampling_params, d.eos_token_ids,
                                  tuple(list(t) for t in d.block_ids), d.lora_request, d.images)
            self.requests[d.request_id] = state
        else:
            state = self.requests[d.request_id]
            state.output_token_ids.extend(d.new_output_token_ids)
            for table, blocks, gone in zip(state.block_ids, d.new_block_ids, d.nulled):
                table.extend(blocks)
                for i in gone:
                    table[i] = NULL_BLOCK
        prompt, outputs = state.prompt_token_ids, state.output_token_ids
        start, end = d.start_pos, d.start_pos + d.num_tokens
        if end > len(prompt) + len(outputs):
            raise RuntimeError(f"step message for {d.request_id!r} computes tokens the worker was never sent")
        tokens = prompt[start:end] + outputs[max(0, start - len(prompt)):max(0, end - len(prompt))]
        return ScheduledChunk(d.request_id, tokens + list(d.spec_token_ids), start, state.block_ids, d.sample,
                              state.sampling_params, prompt, outputs, state.eos_token_ids, state.lora_request,
                              num_spec_tokens=len(d.spec_token_ids), num_lookahead_tokens=d.num_lookahead_tokens,
                              num_evicted_tokens=d.num_evicted_tokens, images=state.images)
