"""Pipeline parallel: the model's layers split into stages, one rank each, a batch flowing through them.

Stage s holds layers `stage_layers(num_layers, s, size)` (and the embedding on the first stage,
the final norm and LM head on the last), with the KV of its layers only. A batch goes stage to
stage as point-to-point messages, never a collective, so that stages run different batches at
once: while stage 1 runs batch k, stage 0 already runs batch k + 1 (the engine keeps one batch
per stage in flight, `Executor.max_concurrent_batches`).

Per batch, stage s receives from stage s - 1 the step message (the same encoded bytes
rank 0 made, forwarded as they came: every stage decodes every step in order, as the step
message's delta encoding needs) and the activations (the hidden states and the residual stream,
[rows, hidden] each), runs its layers and passes both on; the last stage samples and sends the
step's output to rank 0. Sends are asynchronous (gloo's and NCCL's send returns at once and
completes when the peer receives), so no stage waits for the next one to be free.

Layers are built per stage the way tensor-parallel slices are: `build_model` runs in a
`pipeline_scope`, and a family's layer list is made by `make_layers` (blocks.py), which builds
only the stage's layers (the others are placeholders without weights).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from kvflow.scoped import Scoped

# Point-to-point tags: each (peer, tag) is a FIFO, so lengths and bodies never cross.
_STEP_SIZE, _STEP_BODY, _OUT_SIZE, _OUT_BODY, _HIDDEN, _RESIDUAL = range(1, 7)


def stage_layers(num_layers: int, stage: int, num_stages: int) -> range:
    """Stage `stage`'s layers: contiguous, as even as the count allows (earlier stages take one
    more where it does not divide)."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def check_stages(kv_specs: list, num_stages: int, what: str) -> None:
    """ValueError unless `num_stages` stages can split a model whose layers keep `kv_specs`: a stage
    needs a layer at least, and a layer that reads another layer's KV (cross-layer sharing) needs
    that layer on its own stage."""
    if num_stages == 1:
        return
    if num_stages > len(kv_specs):
        raise ValueError(f"pipeline_parallel_size={num_stages} is more stages than {what}'s {len(kv_specs)} layers")
    for stage in range(num_stages):
        layers = stage_layers(len(kv_specs), stage, num_stages)
        for i in layers:
            target = getattr(kv_specs[i], "target_layer", None)
            if target is not None and target not in layers:
                raise ValueError(f"pipeline_parallel_size={num_stages} puts {what}'s layer {i} on stage {stage} and "
                                 f"layer {target}, whose KV it reads, on another; use fewer stages")


@dataclass(frozen=True)
class PipelineStage:
    """Stage `index` of `size`, holding `layers`; `link` moves batches between stages (None for one
    stage, or for a stage built only to load its part, as tests do)."""

    index: int = 0
    size: int = 1
    layers: range | None = None  # None: every layer (one stage)
    link: PipelineLink | None = None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def holds(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers


WHOLE = PipelineStage()
_IN_SCOPE = Scoped("kvflow_pipeline_stage", WHOLE)
pipeline_scope = _IN_SCOPE.scope
current_pipeline_stage = _IN_SCOPE.current


@dataclass
class PipelineLink:
    """One rank's ends of the pipeline: step messages and outputs on `cpu_group` (gloo), activations
    (of `dtype`, the model's) on `device_group` (gloo on CPU, NCCL on GPU), both over every rank of
    the engine. Ranks are stage-major (`for_rank`); each tensor-parallel rank of a stage talks to the
    same tensor-parallel rank of the next, rank 0 hands the steps to its own stage's other ranks,
    and the last stage's first rank returns the outputs to rank 0. Sends stay referenced until done."""

    cpu_group: object
    device_group: object
    dtype: torch.dtype
    timeout: timedelta
    step_from: int | None  # where this rank's steps come from (None: rank 0, which makes them)
    step_to: tuple[int, ...]  # where it passes them on
    act_from: int | None  # the previous stage's rank (None: the first stage)
    act_to: int | None  # the next stage's rank (None: the last stage)
    output_to: int | None  # rank 0, from the last stage's first rank
    output_from: int | None  # on rank 0: that rank
    _sends: list = field(default_factory=list)

    @classmethod
    def for_rank(cls, rank: int, tp: int, pp: int, cpu_group, device_group, dtype: torch.dtype,
                 timeout: timedelta) -> PipelineLink:
        """Rank `rank` of `pp` stages of `tp` tensor-parallel ranks each: stage rank // tp."""
        stage, tp_rank = divmod(rank, tp)
        last = pp - 1
        return cls(cpu_group, device_group, dtype, timeout,
                   step_from=None if rank == 0 else (0 if stage == 0 else rank - tp),
                   step_to=((rank + tp,) if stage < last else ()) + (tuple(range(1, tp)) if rank == 0 else ()),
                   act_from=rank - tp if stage > 0 else None,
                   act_to=rank + tp if stage < last else None,
                   output_to=0 if stage == last and tp_rank == 0 else None,
                   output_from=last * tp if rank == 0 else None)

    # -- step messages, from rank 0 along the stages ----------------------------------------------
    def send_step(self, payload: bytes | None) -> None:
        """To the ranks this one passes steps to: an encoded step, or None (stop)."""
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([-1 if payload is None else body.numel()], dtype=torch.int64)
        for dst in self.step_to:
            self._send(self.cpu_group, size, dst, _STEP_SIZE)
            if body.numel():
                self._send(self.cpu_group, body, dst, _STEP_BODY)

    def recv_step(self, timeout: timedelta) -> bytes | None:
        """The next step (None: stop). `timeout`: how long it may take to come."""
        size = torch.zeros(1, dtype=torch.int64)
        self.cpu_group.recv([size], self.step_from, _STEP_SIZE).wait(timeout)
        if int(size) < 0:
            return None
        body = torch.empty(int(size), dtype=torch.uint8)
        if body.numel():
            self.cpu_group.recv([body], self.step_from, _STEP_BODY).wait(self.timeout)
        return body.numpy().tobytes()

    # -- activations, stage s → s + 1 ---------------------------------------------------------
    def send_activations(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        self._send(self.device_group, hidden.contiguous(), self.act_to, _HIDDEN)
        self._send(self.device_group, residual.contiguous(), self.act_to, _RESIDUAL)

    def recv_activations(self, rows: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.empty(rows, width, dtype=self.dtype, device=device)
        residual = torch.empty_like(hidden)
        self.device_group.recv([hidden], self.act_from, _HIDDEN).wait(self.timeout)
        self.device_group.recv([residual], self.act_from, _RESIDUAL).wait(self.timeout)
        return hidden, residual

    # -- outputs, last stage → rank 0 -----------------------------------------------------------
    def send_output(self, output: object) -> None:
        body = torch.frombuffer(bytearray(pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        self._send(self.cpu_group, torch.tensor([body.numel()], dtype=torch.int64), self.output_to, _OUT_SIZE)
        self._send(self.cpu_group, body, self.output_to, _OUT_BODY)

    def expect_output(self) -> OutputFuture:
        """On rank 0: the output of the batch just sent (outputs come back in the order batches went)."""
        size = torch.zeros(1, dtype=torch.int64)
        return OutputFuture(self, size, self.cpu_group.recv([size], self.output_from, _OUT_SIZE))

    def flush(self) -> None:
        """Wait (at most the timeout each) for this rank's sends to be received: before it exits."""
        for work, _ in self._sends:
            work.wait(self.timeout)
        self._sends.clear()

    def _send(self, group, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._sends = [(work, t) for work, t in self._sends if not work.is_completed()]
        self._sends.append((group.send([tensor], dst, tag), tensor))


class OutputFuture:
    """A batch's output on its way back from the last stage: `done()` without waiting, `result()`
    waiting (at most the link's timeout; a peer that died fails it at once)."""

    def __init__(self, link: PipelineLink, size: torch.Tensor, work) -> None:
        self._link, self._size, self._work = link, size, work

    def done(self) -> bool:
        return self._work.is_completed()

    def result(self):
        link = self._link
        self._work.wait(link.timeout)
        body = torch.empty(int(self._size), dtype=torch.uint8)
        link.cpu_group.recv([body], link.output_from, _OUT_BODY).wait(link.timeout)
        return pickle.loads(body.numpy().tobytes())
