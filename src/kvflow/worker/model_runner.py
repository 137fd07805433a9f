"""Runs one step: a SchedulerOutput becomes one flat batch, one forward pass, and tokens.

The flat batch concatenates every scheduled chunk: `input_ids[T]`, `positions[T]`, and the
attention metadata that tells attention which rows belong to which request. Logits are computed
only at rows that need them: the last row of a chunk that samples (its last k + 1 rows when it
carries k proposals to verify), and prompt rows whose next token's logprob was asked for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kvflow.attention.metadata import AttentionMetadata
from kvflow.core.runner_output import ModelRunnerOutput, PositionLogprobs
from kvflow.core.sched_output import ScheduledChunk, SchedulerOutput, StepGrammar
from kvflow.distributed.pipeline import WHOLE, PipelineStage
from kvflow.kv_cache_spec import KVLayout
from kvflow.lora.manager import LoRAManager
from kvflow.model.layers.sampler import Sampler, SamplerOutput, SamplingBatch, gather_logprobs
from kvflow.worker.cpu_decode import CpuDecodeLoop
from kvflow.worker.cuda_graphs import DecodeGraphs
from kvflow.worker.kv_cache import unique_caches
from kvflow.worker.kv_connector import KVStoreConnectorWorker
from kvflow.worker.multimodal import ImageRows
from kvflow.worker.speculator import Speculator, StepRows, VerifyRow

# Prompt-logprob rows are scored this many at a time: a long prompt's [rows, vocab] logits (and
# their log-softmax) would otherwise take gigabytes at once.
PROMPT_LOGPROB_ROWS = 256


@dataclass
class FlatBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: tuple[AttentionMetadata, ...]  # one per KV group: same rows, that group's block tables
    sample_rows: list[int]  # row of each sampling chunk's last token (and of its proposals)
    sample_chunks: list[ScheduledChunk]
    prompt_rows: list[int]  # rows whose next token is a prompt token with logprobs requested
    prompt_targets: list[int]
    prompt_spans: dict[str, tuple[int, int, int, int]]  # request → (first position, first row index, count, top-N)
    inputs_embeds: torch.Tensor | None = None  # the first layer's input rows, when images replace some
    chunks: list[ScheduledChunk] | None = None  # every chunk, in row order (an EAGLE head reads their rows)


class ModelRunner:
    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], block_size: int, device, seed: int,
                 host_kv_caches: list[torch.Tensor] | None = None,
                 decode_graphs: DecodeGraphs | CpuDecodeLoop | None = None, *, lora: LoRAManager | None = None,
                 kv_connector: KVStoreConnectorWorker | None = None,
                 build_speculator: Callable[[ModelRunner], Speculator] | None = None,
                 stage: PipelineStage = WHOLE, kv_layout: KVLayout | None = None) -> None:
        """`lora`: the adapters' slots (the model's linear layers already wrapped); `kv_connector`: KV
        moving between engines; `build_speculator`: the runner builds its drafter with it, since the
        drafter shares the runner's sampler and flat-batch builder (and, for layer skip, its model);
        `stage`: the pipeline stage this runner runs (only the last samples); `kv_layout`: the KV
        groups, for what their tables mean (a state group's is one block; a KV budget compacts only
        full-attention tables). None: one full-attention group."""
        layout_groups = () if kv_layout is None else tuple(zip(kv_layout.sliding_windows, kv_layout.state_groups))
        self.state_groups = tuple(state for _, state in layout_groups)
        self.compacted_groups = tuple(window is None and not state for window, state in layout_groups) or (True,)
        self.model = model
        self.stage = stage
        self.lora = lora
        self.kv_caches = kv_caches
        self.host_kv_caches = host_kv_caches  # swap space, same layout, in host memory
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(seed))
        self.generators: dict[str, torch.Generator] = {}  # per seeded request, for its whole life
        self.decode_graphs = decode_graphs
        self.kv_connector = kv_connector
        self.speculator: Speculator | None = None if build_speculator is None else build_speculator(self)
        # An EAGLE-3 head reads layers' inputs, which the fast steps (running no module) do not keep:
        # its steps run through the modules. EAGLE-1's feature is the fast steps' output as it is.
        self.modules_only = self.speculator is not None and self.speculator.reads_layer_states
        # A model that reads images in its prompts (kvflow.model.models.idefics3): their rows, by hash.
        self.image_rows = ImageRows(model) if hasattr(model, "encode_images") else None
        # With sparse decode, the attention backend's per-block key summaries (one backend per model).
        self.key_summaries = next((summaries for m in model.modules() if (summaries := getattr(
            getattr(m, "backend", None), "key_summaries", None)) is not None), None) if model is not None else None

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in sched.finished_request_ids:
            self.generators.pop(request_id, None)
        if self.speculator is not None:
            self.speculator.drop([*sched.finished_request_ids, *sched.preempted_request_ids])
        # Order matters: a block may be swapped out, then reused as a copy's destination or a
        # swap-in's, all before the forward pass writes the step's new K/V.
        self._swap(sched.swap_out, to_host=True)
        self._copy_blocks(sched.block_copies)
        self._swap(sched.swap_in, to_host=False)
        self._refresh_key_summaries([d for _, d in sched.block_copies] + [d for d, _ in sched.swap_in])
        out = ModelRunnerOutput()
        if self.kv_connector is not None:  # loads that ran beside the steps land here (KV offloading)
            self.kv_connector.begin_step(sched.kv_connector_metadata, not sched.chunks, out)
        if not sched.chunks:
            return out
        transfers = sched.kv_connector_metadata
        if transfers is not None and transfers.loads:
            out.kv_load_failed |= self.kv_connector.load_kv(transfers, out.kv_transfer)
            self._refresh_key_summaries([load.block_id for load in transfers.loads])
        started = time.perf_counter()
        batch = self.prepare(sched.chunks)
        verifying = any(c.num_spec_tokens for c in batch.sample_chunks)
        hidden = self._forward(batch)
        if not self.stage.is_last:  # the next stage carries the batch on; the last one's output is the step's
            return out
        if transfers is not None and transfers.saves:  # the forward pass wrote the prompts' last KV
            self.kv_connector.save_kv(transfers, out.kv_transfer, skip=out.kv_load_failed)
        if batch.sample_rows:
            chunks = batch.sample_chunks
            fields = self._grammar_fields(chunks, sched.grammar)
            if verifying:
                logits = self.model.compute_logits(hidden[batch.sample_rows])
                self.speculator.verify(chunks, logits, lambda rows: self._sampling_batch(rows, fields),
                                       self._generator, out)
            else:
                # Filled on the host while an accelerator still runs the forward pass.
                sampling = self._sampling_batch(chunks, fields)
                # In the head's dtype: the sampler widens them where it adjusts them, and a plain
                # greedy batch takes their argmax as they are.
                logits = self.model.compute_logits(hidden[batch.sample_rows], widen=False)
                self._collect_samples(chunks, self.sampler(logits, sampling), out)
        if batch.prompt_rows:
            self._collect_prompt_logprobs(batch, hidden, out)
        out.target_seconds = time.perf_counter() - started  # the sampled ids were read back: the device is done
        if self.speculator is not None:
            proposing = time.perf_counter()
            # An EAGLE head reads the rows of the whole step: `hidden` is already there, so it costs nothing.
            step = StepRows(batch.chunks, hidden) if self.speculator.reads_target_states else None
            self.speculator.propose(batch.sample_chunks, self._generator, out, step)
            out.proposer_seconds = time.perf_counter() - proposing
        if out.kv_load_failed:
            self._discard_failed_loads(out)
        return out

    def _discard_failed_loads(self, out: ModelRunnerOutput) -> None:
        """These requests ran on KV the connector could not load: nothing they produced counts, and
        their sampling starts again from its seed (they had sampled nothing before)."""
        for request_id in out.kv_load_failed:
            for produced in (out.sampled, out.logprobs, out.prompt_logprobs, out.draft_token_ids):
                produced.pop(request_id, None)
            self.generators.pop(request_id, None)
        if self.speculator is not None:
            self.speculator.drop(list(out.kv_load_failed))

    def _forward(self, batch: FlatBatch) -> torch.Tensor | None:
        if self.stage.size > 1:
            return self._forward_stage(batch)
        graphs = self.decode_graphs
        if batch.inputs_embeds is not None:
            return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn, batch.inputs_embeds)
        if graphs is not None and not self.modules_only and graphs.can_replay(batch.attn[0]):
            return graphs.run(batch.input_ids, batch.positions, batch.attn)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn)

    def _forward_stage(self, batch: FlatBatch) -> torch.Tensor | None:
        """This pipeline stage's layers, from the previous stage's activations (but on the first),
        on to the next stage's (but from the last, which returns the hidden states to sample from)."""
        stage, decoder = self.stage, self.model.model
        carried = None
        if not stage.is_first:
            carried = stage.link.recv_activations(batch.input_ids.shape[0], self.model.config.hidden_size, self.device)
        result = decoder.forward_stage(stage, batch.input_ids, batch.positions, self.kv_caches, batch.attn, carried)
        if stage.is_last:
            return result
        stage.link.send_activations(*result)
        return None

    def _refresh_key_summaries(self, blocks: list[int]) -> None:
        """Sparse decode reads a block's key summary (attention/sparse_decode.py): blocks filled
        without a KV write (copied, swapped in, loaded) are summarized again."""
        if self.key_summaries is not None and blocks:
            self.key_summaries.refresh_everywhere(torch.tensor(blocks, device=self.device), self.block_size)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in unique_caches(self.kv_caches):
            cache[:, dst] = cache[:, src]

    def _swap(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        if not pairs:
            return
        device_ids = torch.tensor([d for d, _ in pairs], device=self.device)
        host_ids = torch.tensor([h for _, h in pairs])
        for device_cache, host_cache in zip(unique_caches(self.kv_caches), unique_caches(self.host_kv_caches)):
            if to_host:
                host_cache[:, host_ids] = device_cache[:, device_ids].to("cpu")
            else:
                device_cache[:, device_ids] = host_cache[:, host_ids].to(self.device)

    # -- inputs ----------------------------------------------------------------------------
    def prepare(self, chunks: list[ScheduledChunk]) -> FlatBatch:
        dev = self.device
        if self.lora is not None:  # rows of one adapter next to each other: few segments per layer
            chunks = sorted(chunks, key=lambda c: 0 if c.lora_request is None else c.lora_request.lora_int_id)
        # The indices are worked out in numpy and handed to torch once each: a decode step of a few
        # requests is ~20 operations on tiny arrays, which cost ~15 µs each as torch calls.
        query_lens = [c.num_tokens for c in chunks]
        lens = np.array(query_lens, dtype=np.int64)
        starts = np.array([c.start_pos for c in chunks], dtype=np.int64)
        query_start_loc = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(lens, out=query_start_loc[1:])
        row_request = np.repeat(np.arange(len(chunks)), lens)
        positions = starts[row_request] + np.arange(row_request.size) - query_start_loc[row_request]
        # A request with a KV budget keeps its survivors compacted in full-attention tables: there a
        # token's KV index is its position less the request's evicted tokens (without a budget in the
        # step, every group reads the positions themselves).
        evicted = np.array([c.num_evicted_tokens for c in chunks], dtype=np.int64) if any(
            c.num_evicted_tokens for c in chunks) else None
        num_groups = len(chunks[0].block_ids)
        offsets = [evicted if evicted is not None and self._compacted(g) else None for g in range(num_groups)]
        # Every slot a chunk writes must lie in its block tables: past them, padding would name
        # another request's block. The scheduler guarantees it; a bug must not write silently.
        assert all(c.start_pos - (0 if gone is None else int(gone[i])) + c.num_tokens <= len(t) * self.block_size
                   for i, c in enumerate(chunks) for g, (t, gone) in enumerate(zip(c.block_ids, offsets))
                   if not self._holds_state(g)), "a chunk writes past its block table"
        width = max(len(t) for c in chunks for t in c.block_ids) + 1  # one more column: where an overrun lands
        # [groups, requests, width]. Writes pad with -1, a slot that writes nothing. Reads see block 0
        # there (masked by seq_lens) and where a sliding window gave a block back (NULL_BLOCK, -1;
        # the window mask hides it).
        slot_tables = np.array([[c.block_ids[g] + [-1] * (width - len(c.block_ids[g])) for c in chunks]
                                for g in range(num_groups)], dtype=np.int64)
        lora = None if self.lora is None else self.lora.prepare([c.lora_request for c in chunks], query_lens)
        query_start_loc_t = _tensor(query_start_loc, dev)
        seq_lens_cpu = (starts + lens).tolist()
        seq_lens = torch.tensor(seq_lens_cpu, device=dev)
        attn = tuple(self._group_metadata(slots, positions, seq_lens_cpu, seq_lens, row_request, width,
                                          query_start_loc_t, query_lens, lora) if gone is None else
                     self._group_metadata(slots, positions - gone[row_request], (starts - gone + lens).tolist(), None,
                                          row_request, width, query_start_loc_t, query_lens, lora)
                     for slots, gone in zip(slot_tables, offsets))
        positions = _tensor(positions, dev)
        input_ids = torch.tensor([t for c in chunks for t in c.token_ids], device=dev)
        batch = FlatBatch(input_ids, positions, attn, [], [], [], [], {}, chunks=chunks)
        if self.image_rows is not None:
            batch.inputs_embeds = self.image_rows.inputs_embeds(chunks, input_ids)
        offset = 0
        for chunk, q_len in zip(chunks, query_lens):
            if chunk.sample:
                batch.sample_rows.extend(range(offset + q_len - 1 - chunk.num_spec_tokens, offset + q_len))
                batch.sample_chunks.append(chunk)
            if chunk.sampling_params.prompt_logprobs is not None:
                self._add_prompt_rows(batch, chunk, offset)
            offset += q_len
        return batch

    def _group_metadata(self, slots: np.ndarray, kv_index: np.ndarray, seq_lens_cpu: list[int],
                        seq_lens: torch.Tensor | None, row_request: np.ndarray, width: int,
                        query_start_loc: torch.Tensor, query_lens: list[int], lora) -> AttentionMetadata:
        """One KV group's metadata: its tables `slots`, each row's KV index in them; `seq_lens`: the
        groups' shared tensor of `seq_lens_cpu`, or None to make this group's."""
        dev = self.device
        block_index, in_block = np.minimum(kv_index // self.block_size, width - 1), kv_index % self.block_size
        return AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=torch.tensor(seq_lens_cpu, device=dev) if seq_lens is None else seq_lens,
            block_tables=_tensor(np.maximum(slots[:, :-1], 0), dev),
            slot_mapping=_tensor(_slot_mapping(slots[row_request, block_index], in_block, self.block_size), dev),
            block_size=self.block_size,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens_cpu,
            lora=lora,
        )

    def _compacted(self, group: int) -> bool:
        return group >= len(self.compacted_groups) or self.compacted_groups[group]

    def _holds_state(self, group: int) -> bool:
        return group < len(self.state_groups) and self.state_groups[group]

    @staticmethod
    def _add_prompt_rows(batch: FlatBatch, chunk: ScheduledChunk, offset: int) -> None:
        # Row at position p predicts token p + 1; only prompt tokens are targets.
        last = min(chunk.start_pos + chunk.num_tokens, len(chunk.prompt_token_ids) - 1)
        count = last - chunk.start_pos
        if count <= 0:
            return
        n = chunk.sampling_params.prompt_logprobs
        batch.prompt_spans[chunk.request_id] = (chunk.start_pos, len(batch.prompt_rows), count, n)
        batch.prompt_rows.extend(range(offset, offset + count))
        batch.prompt_targets.extend(chunk.prompt_token_ids[chunk.start_pos + 1:last + 1])

    def _sampling_batch(self, chunks: list[ScheduledChunk | VerifyRow], grammar_fields: dict | None = None) -> SamplingBatch:
        """One row per chunk (or per verified position); `grammar_fields`: the rows' grammar masks
        (SamplingBatch's fields; empty when no row has a grammar)."""
        params = [c.sampling_params for c in chunks]
        # The float parameters as one tensor, a row each (one torch call where there were six:
        # ~40 µs of a batch-1 token).
        (temperature, top_p, min_p, repetition_penalty, frequency_penalty, presence_penalty) = torch.tensor(
            [[getattr(p, name) for p in params] for name in _FLOAT_PARAMS], dtype=torch.float32, device=self.device)
        return SamplingBatch(
            temperature=temperature,
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=self.device),
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            prompt_token_ids=[c.prompt_token_ids for c in chunks],
            output_token_ids=[c.output_token_ids for c in chunks],
            banned_token_ids=[_banned_tokens(c) for c in chunks],
            generators=[self._generator(c) for c in chunks],
            num_logprobs=max((-1 if p.logprobs is None else p.logprobs) for p in params),
            all_greedy=all(p.greedy for p in params),
            any_penalties=any(p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0
                              for p in params),
            any_top_k_or_p=any(p.top_k > 0 or p.top_p < 1 for p in params),
            logit_bias=[p.logit_bias or {} for p in params] if any(p.logit_bias for p in params) else None,
            **(grammar_fields or {}),
        )

    def _grammar_fields(self, chunks: list[ScheduledChunk], grammar: StepGrammar | None) -> dict:
        """SamplingBatch's grammar fields for the sampling chunks' logit rows (a chunk's k + 1
        rows when it verifies k proposals), from the engine's masks; empty when no row has one."""
        if grammar is None:
            return {}
        mask_rows, logit_rows, offset = [], [], 0
        for chunk in chunks:
            count = chunk.num_spec_tokens + 1
            first = grammar.first_row.get(chunk.request_id)
            if first is not None:
                mask_rows.extend(range(first, first + count))
                logit_rows.extend(range(offset, offset + count))
            offset += count
        if not mask_rows:
            return {}
        bitmask = grammar.bitmask if len(mask_rows) == grammar.bitmask.shape[0] and mask_rows == sorted(mask_rows) \
            else grammar.bitmask[mask_rows]
        return {"grammar_bitmask": bitmask.to(self.device, non_blocking=True),
                "grammar_rows": torch.tensor(logit_rows, device=self.device)}

    def _generator(self, chunk: ScheduledChunk) -> torch.Generator | None:
        seed = chunk.sampling_params.seed
        if seed is None or chunk.sampling_params.greedy:
            return None
        if chunk.request_id not in self.generators:
            self.generators[chunk.request_id] = torch.Generator(device=self.device).manual_seed(generator_seed(seed))
        return self.generators[chunk.request_id]

    # -- outputs ---------------------------------------------------------------------------
    @staticmethod
    def _collect_samples(chunks: list[ScheduledChunk], sampled: SamplerOutput, out: ModelRunnerOutput) -> None:
        tokens = sampled.token_ids.tolist()
        logprobs = None if sampled.logprobs is None else sampled.logprobs.tolist()
        ids = None if sampled.logprob_token_ids is None else sampled.logprob_token_ids.tolist()
        ranks = None if sampled.sampled_ranks is None else sampled.sampled_ranks.tolist()
        for i, chunk in enumerate(chunks):
            out.sampled[chunk.request_id] = [tokens[i]]
            n = chunk.sampling_params.logprobs
            if n is not None:
                out.logprobs[chunk.request_id] = [PositionLogprobs(ids[i][:n + 1], logprobs[i][:n + 1], ranks[i])]

    def _collect_prompt_logprobs(self, batch: FlatBatch, hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        targets = torch.tensor(batch.prompt_targets, device=hidden.device)
        num_top = max(span[3] for span in batch.prompt_spans.values())
        parts = []
        for first in range(0, len(batch.prompt_rows), PROMPT_LOGPROB_ROWS):
            rows = batch.prompt_rows[first:first + PROMPT_LOGPROB_ROWS]
            logits = self.model.compute_logits(hidden[rows])
            parts.append(gather_logprobs(logits.log_softmax(dim=-1), targets[first:first + len(rows)], num_top))
        values, ids, ranks = (torch.cat(column).tolist() for column in zip(*parts))
        for request_id, (first_pos, first, count, n) in batch.prompt_spans.items():
            rows = range(first, first + count)
            entries = [PositionLogprobs(ids[j][:n + 1], values[j][:n + 1], ranks[j]) for j in rows]
            out.prompt_logprobs[request_id] = (first_pos + 1, entries)


_FLOAT_PARAMS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def _banned_tokens(chunk: ScheduledChunk) -> list[int]:
    params = chunk.sampling_params
    if len(chunk.output_token_ids) >= params.min_tokens:
        return []
    banned = list(params.stop_token_ids)
    if not params.ignore_eos:
        banned.extend(chunk.eos_token_ids)
    return banned


def generator_seed(seed: int) -> int:
    """The seed torch's generator gets for a request's 64-bit `seed`. The CPU generator (a
    Mersenne Twister) keeps only a seed's low 32 bits, so seeds that differ above them would draw
    the same samples. Seeds in [0, 2^32) are kept as they are; any other is folded into 32 bits by
    a mixing hash (SplitMix64's finalizer), so distinct seeds give distinct samples but for chance
    collisions of 32-bit values."""
    if 0 <= seed < 1 << 32:
        return seed
    z = seed % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return (z ^ (z >> 31)) >> 32


def _slot_mapping(blocks: np.ndarray, in_block: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot of each written row; -1 (writes nothing) where its block is -1."""
    return np.where(blocks < 0, -1, blocks * block_size + in_block)


def _tensor(array: np.ndarray, device) -> torch.Tensor:
    """A contiguous int64 tensor on `device` (on CPU it shares the array's memory)."""
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)
