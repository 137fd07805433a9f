"""`kvflow train-drafter MODEL OUT --method eagle`: distil an EAGLE-1 head from the target on the CPU.

The target (kvflow's own engine: its loader, its kernels, its dtype) writes the data and the
features once (`train_eagle_data`, `train_eagle_target`); then a plain-torch head
(`train_eagle_head`) learns, with autograd over whole sequences, what the EAGLE papers train:

    loss = 1.0 · smooth-L1(h, feature[p+1])                           (feature regression)
         + 0.1 · cross-entropy(softmax(lm_head(feature[p+1])), lm_head(h))   (the target's tokens)

with EAGLE's weights, AdamW (β = 0.9, 0.95), gradients clipped by value at 0.5, and uniform noise
of ±0.1 on the input features (EAGLE-1: at serving the head reads its own, inexact features from
the second draft on, and the noise teaches it to tolerate them).

OUT holds the head in the checkpoint format (`config.json`, `model.safetensors`, float32) and,
in `trainer/`, the training data (`data.json`), the optimizer's state (`optimizer.safetensors`)
and `state.json`, written last: the step the head and the optimizer are at. It is written every
`save_every` steps, at the end, and on Ctrl-C (after the step in flight). `resume` continues: every
step's batch and noise are functions of (seed, step) alone, the data and its features are the
same, and the parameters and optimizer state are restored bit for bit, so N steps, a stop, and M
more give exactly the head N + M steps in one run give.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from kvflow.spec_decode.train_eagle_data import DATA_FILE, Sequence, TrainingData, build_training_data
from kvflow.spec_decode.train_eagle_head import (
    HEAD_FILE,
    EagleHead,
    HeadShape,
    eagle_config,
    load_head_tensors,
    save_head,
)
from kvflow.spec_decode.train_eagle_target import check_target, frozen_target, last_layer_tensors, target_features

# The training state lives in OUT/trainer/: loaders take every *.safetensors at a model directory's
# top (vLLM's and kvflow's), where the optimizer's tensors would be read as the head's.
STATE_FILE = "trainer/state.json"
OPTIMIZER_FILE = "trainer/optimizer.safetensors"
FEATURE_WEIGHT, TOKEN_WEIGHT = 1.0, 0.1  # EAGLE's v_w and p_w
FEATURE_NOISE = 0.1  # EAGLE-1's U(-0.1, 0.1) on the input features
BETAS = (0.9, 0.95)
GRAD_CLIP = 0.5  # by value, as EAGLE clips
WARMUP_STEPS = 25  # linear warm-up: Adam's first steps move every weight by about lr at once
SEED_STRIDE = 1_000_003  # P: the generator seeds of one --seed lie apart from the next seed's
# What a resumed run must share with the run it continues (flags named as the CLI spells them).
RUN_FIELDS = {"seq_len": "--seq-len", "batch_size": "--batch-size", "lr": "--lr", "seed": "--seed"}


@dataclass(frozen=True)
class TrainSettings:
    seq_len: int = 512
    batch_size: int = 2
    lr: float = 1e-3
    seed: int = 0
    max_steps: int | None = None  # the step to stop at, counted from the run's start (a resumed run's too)
    time_budget_s: float | None = None  # seconds of training in this process
    save_every: int = 100
    text_tokens: int = 32768
    chat_prompts: int = 64

    def __post_init__(self) -> None:
        for flag, value, low in (("--seq-len", self.seq_len, 4), ("--batch-size", self.batch_size, 1),
                                 ("--save-every", self.save_every, 1), ("--text-tokens", self.text_tokens, 0),
                                 ("--chat-prompts", self.chat_prompts, 0)):
            if value < low:
                raise ValueError(f"{flag} must be >= {low}; got {value}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0; got {self.lr}")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"--max-steps must be >= 0; got {self.max_steps}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"--time-budget must be > 0 seconds; got {self.time_budget_s}")
        if self.max_steps is None and self.time_budget_s is None:
            raise ValueError("give --max-steps or --time-budget (or both): training has no end otherwise")


@dataclass(frozen=True)
class Batch:
    next_tokens: torch.Tensor  # [B, L] token[p+1] of each pair
    features: torch.Tensor  # [B, L, H] feature[p], noised when training
    targets: torch.Tensor  # [B, L, H] feature[p+1]
    mask: torch.Tensor  # [B, L] pairs that count (inside the sequence, predicting an answer token)


@dataclass(frozen=True)
class Losses:
    total: torch.Tensor
    feature: float
    token: float
    agreed: int  # pairs whose top-1 token is the target's
    counted: int


@dataclass(frozen=True)
class TrainResult:
    step: int
    held_out_top1: float
    losses: dict[str, float]


def make_batch(items: list[tuple[Sequence, torch.Tensor]], noise: torch.Generator | None) -> Batch:
    """Pairs (token[p+1], feature[p]) → feature[p+1] of each sequence, padded to the longest."""
    length = max(len(seq.tokens) for seq, _ in items) - 1
    hidden = items[0][1].shape[-1]
    next_tokens = torch.zeros(len(items), length, dtype=torch.long)
    features, targets = torch.zeros(len(items), length, hidden), torch.zeros(len(items), length, hidden)
    mask = torch.zeros(len(items), length, dtype=torch.bool)
    for b, (seq, feats) in enumerate(items):
        n = len(seq.tokens) - 1
        next_tokens[b, :n] = torch.tensor(seq.tokens[1:])
        features[b, :n], targets[b, :n] = feats[:-1], feats[1:]
        mask[b, max(seq.answer_start - 2, 0):n] = True  # pair p predicts token p + 2
    if noise is not None:
        features += (torch.rand(features.shape, generator=noise) * 2 - 1) * FEATURE_NOISE
    return Batch(next_tokens, features, targets, mask)


def eagle_losses(head: EagleHead, batch: Batch) -> Losses:
    """EAGLE's loss over the pairs that count, and how often the head's top-1 is the target's."""
    h = head(batch.next_tokens, batch.features)[batch.mask]
    targets = batch.targets[batch.mask]
    logits = head.logits(h)
    with torch.no_grad():
        target_logits = head.logits(targets)
    token = -(target_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
    feature = F.smooth_l1_loss(h, targets, reduction="none").mean(-1).mean()
    agreed = int((logits.argmax(-1) == target_logits.argmax(-1)).sum())
    return Losses(FEATURE_WEIGHT * feature + TOKEN_WEIGHT * token, feature.item(), token.item(), agreed,
                  int(batch.mask.sum()))


class Trainer:
    """The head, its optimizer and the featured data; `step` steps done."""

    def __init__(self, head: EagleHead, train: list[tuple[Sequence, torch.Tensor]],
                 held_out: list[tuple[Sequence, torch.Tensor]], settings: TrainSettings) -> None:
        if not train:
            raise ValueError("no training sequences: raise --text-tokens or --chat-prompts")
        self.head, self.train, self.held_out, self.settings = head, train, held_out, settings
        self.optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, betas=BETAS)
        self.step = 0
        self._epoch_order: tuple[int, list[int]] = (-1, [])  # (epoch, its order of the training sequences)

    def batch_for(self, step: int) -> Batch:
        """Step `step`'s batch and noise: functions of (seed, step) only. Step s draws its noise
        from generator seed·P + s and epoch e its order from seed·P − e − 1: no two share one."""
        size, count = self.settings.batch_size, len(self.train)
        picks = [self._order(k // count)[k % count] for k in range(step * size, (step + 1) * size)]
        noise = torch.Generator().manual_seed(self.settings.seed * SEED_STRIDE + step)
        return make_batch([self.train[i] for i in picks], noise)

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_order[0] != epoch:
            gen = torch.Generator().manual_seed(self.settings.seed * SEED_STRIDE - epoch - 1)
            self._epoch_order = (epoch, torch.randperm(len(self.train), generator=gen).tolist())
        return self._epoch_order[1]

    def train_step(self) -> Losses:
        for group in self.optimizer.param_groups:
            group["lr"] = self.settings.lr * min(1.0, (self.step + 1) / WARMUP_STEPS)
        self.optimizer.zero_grad()
        losses = eagle_losses(self.head, self.batch_for(self.step))
        losses.total.backward()
        torch.nn.utils.clip_grad_value_(self.head.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.step += 1
        return losses

    @torch.no_grad()
    def held_out_top1(self) -> float:
        """The share of held-out pairs (no noise) whose top-1 token is the target's."""
        agreed = counted = 0
        size = self.settings.batch_size
        for start in range(0, len(self.held_out), size):
            losses = eagle_losses(self.head, make_batch(self.held_out[start:start + size], None))
            agreed, counted = agreed + losses.agreed, counted + losses.counted
        return agreed / max(counted, 1)

    def save(self, out: Path, config: dict, report: dict) -> None:
        """The head and the optimizer's state, then the state file that says they are whole."""
        marker = {"step": str(self.step)}
        save_head(self.head, config, out, marker)
        names = [name for name, _ in self.head.named_parameters()]  # the optimizer's parameter order
        tensors = {f"{names[i]}.{key}": value.reshape(-1) for i, state in self.optimizer.state_dict()["state"].items()
                   for key, value in state.items()}
        tmp = out / (OPTIMIZER_FILE + ".tmp")
        save_file(tensors, str(tmp), metadata=marker)
        tmp.replace(out / OPTIMIZER_FILE)
        state = {"step": self.step, **{k: getattr(self.settings, k) for k in RUN_FIELDS}, **report}
        (out / (STATE_FILE + ".tmp")).write_text(json.dumps(state, indent=2) + "\n")
        (out / (STATE_FILE + ".tmp")).replace(out / STATE_FILE)

    def load(self, out: Path, state: dict) -> None:
        """Continue from OUT's checkpoint (`state`: its state file), refused unless whole."""
        step = state["step"]
        for name in (HEAD_FILE, OPTIMIZER_FILE):
            with safe_open(str(out / name), framework="pt") as f:
                if (f.metadata() or {}).get("step") != str(step):
                    raise ValueError(f"{out / name} is not from step {step} of {out / STATE_FILE} (a save was cut "
                                     "short): start again in a new directory")
        params = dict(self.head.named_parameters())
        with torch.no_grad():
            for name, tensor in load_head_tensors(out / HEAD_FILE, self.head.shape).items():
                params[name].copy_(tensor)
        self.optimizer.load_state_dict(self._optimizer_state(out / OPTIMIZER_FILE))
        self.step = step

    def _optimizer_state(self, path: Path) -> dict:
        """AdamW's state dict from the saved tensors (none before the first step)."""
        saved = load_file(str(path))
        state = {i: {"step": saved[f"{name}.step"].reshape(()), "exp_avg": saved[f"{name}.exp_avg"].view_as(param),
                     "exp_avg_sq": saved[f"{name}.exp_avg_sq"].view_as(param)}
                 for i, (name, param) in enumerate(self.head.named_parameters()) if f"{name}.step" in saved}
        return {"state": state, "param_groups": self.optimizer.state_dict()["param_groups"]}


def run_training(llm, out: Path, settings: TrainSettings, resume: bool = False, progress: bool = True) -> TrainResult:
    """Train the head of `llm`'s target (a `kvflow.LLM` built without prefix caching) into `out`,
    or with `resume` go on from the checkpoint there."""
    engine = llm.llm_engine
    check_target(engine.arch)
    state = _prepare_out(out, settings, engine.config.model.max_model_len, resume)
    if resume:
        data = TrainingData.load(out)
    else:
        data = build_training_data(llm, settings.seq_len, settings.text_tokens, settings.chat_prompts)
        data.save(out)
    train = list(zip(data.train, target_features(engine, [s.tokens for s in data.train])))
    held_out = list(zip(data.held_out, target_features(engine, [s.tokens for s in data.held_out])))
    model, shape = engine.runner.model, HeadShape.from_arch(engine.arch)
    head = EagleHead(shape, frozen_target(model))
    head.init_from_target(last_layer_tensors(model))
    trainer = Trainer(head, train, held_out, settings)
    if state is not None:
        trainer.load(out, state)
    return _train(trainer, out, eagle_config(dict(engine.hf_config), engine.arch), progress)


def _prepare_out(out: Path, settings: TrainSettings, max_model_len: int, resume: bool) -> dict | None:
    """Check OUT and the settings before any work; with `resume`, OUT's state."""
    if settings.seq_len > max_model_len:
        raise ValueError(f"--seq-len {settings.seq_len} is longer than the model's context ({max_model_len} tokens)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT {out} is a file, not a directory")
    if not resume:
        if (out / STATE_FILE).exists():
            raise ValueError(f"{out} holds a training checkpoint already: continue it with --resume, or choose "
                             "another directory")
        (out / STATE_FILE).parent.mkdir(parents=True, exist_ok=True)
        return None
    state = read_state(out)
    for field, flag in RUN_FIELDS.items():
        if state[field] != getattr(settings, field):
            raise ValueError(f"{flag} {getattr(settings, field)} differs from the checkpoint's {state[field]} "
                             f"({out / STATE_FILE}); resume with the same value")
    if not (out / DATA_FILE).is_file():
        raise FileNotFoundError(f"--resume: {out} has no {DATA_FILE}")
    return state


def _train(trainer: Trainer, out: Path, config: dict, progress: bool) -> TrainResult:
    """Steps until --max-steps, the time budget or Ctrl-C; a checkpoint every `save_every` steps and
    at the end (a Ctrl-C's too, then KeyboardInterrupt)."""
    s = trainer.settings
    deadline = None if s.time_budget_s is None else time.monotonic() + s.time_budget_s
    last: dict[str, float] = {}
    held_out, saved_at = None, None
    with StopRequests() as stop, tqdm(total=s.max_steps, initial=trainer.step, desc="eagle head", unit="step",
                                      disable=not progress) as bar:
        while not stop.requested and (s.max_steps is None or trainer.step < s.max_steps) and (
                deadline is None or time.monotonic() < deadline):
            losses = trainer.train_step()
            last = {"loss": losses.total.item(), "feature_loss": losses.feature, "token_loss": losses.token,
                    "train_top1": losses.agreed / max(losses.counted, 1)}
            if trainer.step % s.save_every == 0:
                held_out, saved_at = _save(trainer, out, config, last), trainer.step
            bar.set_postfix({k: f"{v:.3f}" for k, v in last.items()} | (
                {} if held_out is None else {"held_out_top1": f"{held_out:.3f}"}))
            bar.update(1)
        if saved_at != trainer.step:
            held_out = _save(trainer, out, config, last)
    if stop.requested:
        tqdm.write(f"stopped at step {trainer.step}; the checkpoint is in {out}: continue with --resume")
        raise KeyboardInterrupt
    return TrainResult(trainer.step, held_out, last)


def _save(trainer: Trainer, out: Path, config: dict, losses: dict[str, float]) -> float:
    held_out = trainer.held_out_top1()
    trainer.save(out, config, {"held_out_top1": held_out, "losses": losses})
    return held_out


class StopRequests:
    """Ctrl-C while training asks the loop to stop after the step in flight, so the checkpoint it
    saves is a finished step's (an optimizer step cut in half would not resume to the same
    numbers); a second Ctrl-C interrupts at once. Outside the main thread signals are not
    catchable and nothing is installed."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True


def read_state(out: Path) -> dict:
    path = out / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--resume: {out} holds no checkpoint to resume ({STATE_FILE} is missing)")
    return json.loads(path.read_text())
