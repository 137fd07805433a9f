"""`kvflow train-drafter MODEL OUT --method eagle`: distil a speculative-decoding drafter from a
target on this machine and write it where `speculative_config` can load it (an EAGLE-1 head:
kvflow/spec_decode/train_eagle.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvflow.spec_decode.train_eagle import TrainSettings, run_training

METHODS = ("eagle",)
_NOT_TRAINED = {"draft_model": "a draft model is any smaller model of the target's vocabulary, used as it is",
                "mtp": "multi-token-prediction heads come with the checkpoints that have them"}


def add_train_drafter_parser(sub) -> None:
    d = TrainSettings(max_steps=0)
    p = sub.add_parser("train-drafter", help="distil a drafter for speculative decoding (an EAGLE-1 head) on the CPU")
    p.add_argument("model", help="the target: HF directory or .gguf file; 'default' for SmolLM2")
    p.add_argument("out", help="directory to write the head (and its checkpoint) to")
    p.add_argument("--method", required=True, help=f"what to train: {', '.join(METHODS)}")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop training after this many seconds (the data and features before it do not count)")
    p.add_argument("--max-steps", type=int, default=None, help="stop at this step (counted over resumed runs too)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per training sequence")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW's learning rate (after a short linear warm-up)")
    p.add_argument("--seed", type=int, default=d.seed, help="the batches' order and the feature noise")
    p.add_argument("--save-every", type=int, default=d.save_every, help="write a checkpoint every this many steps")
    p.add_argument("--text-tokens", type=int, default=d.text_tokens,
                   help="tokens of the shipped English text to train on")
    p.add_argument("--chat-prompts", type=int, default=d.chat_prompts,
                   help="chat prompts whose greedy answers by the target to train on")
    p.add_argument("--resume", action="store_true", help="continue from OUT's checkpoint, optimizer state included")
    p.add_argument("--dtype", default="auto", help="the target's dtype (default: what kvflow serves it in)")
    p.add_argument("--device", default="auto", help="the target's device: auto, cpu, or cuda[:N]")
    p.set_defaults(func=run_train_drafter)


def run_train_drafter(args: argparse.Namespace) -> int:
    from kvflow.entrypoints.llm import LLM

    if args.method not in METHODS:
        why = _NOT_TRAINED.get(args.method, "unknown method")
        raise ValueError(f"--method {args.method!r} is not trained by train-drafter ({why}); methods: "
                         f"{', '.join(METHODS)}")
    settings = TrainSettings(seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                             max_steps=args.max_steps, time_budget_s=args.time_budget, save_every=args.save_every,
                             text_tokens=args.text_tokens, chat_prompts=args.chat_prompts)
    # No prefix caching: the features are computed on the engine's pool between requests (train_eagle_target).
    llm = LLM(None if args.model == "default" else args.model, dtype=args.dtype, device=args.device, seed=args.seed,
              enable_prefix_caching=False, swap_space_gb=0, disable_log_stats=True)
    result = run_training(llm, Path(args.out), settings, resume=args.resume)
    print(f"wrote {args.out}: EAGLE head at step {result.step}, held-out top-1 agreement with the target "
          f"{result.held_out_top1:.3f}")
    return 0
