"""The token sequences an EAGLE head is distilled on.

- **The shipped text** (`kvflow.data`, the King James Genesis, Ruth and Luke), cut into windows of
  `seq_len` tokens from its start: plenty of ordinary prose, and the features of any text teach the
  head the target, since every target is scored on its own distribution.
- **The target's own chat answers**, greedy, through its chat template: what the head drafts at
  serving time are continuations the target writes after a chat prompt, a distribution the Bible
  is far from. The prompts are the tasks of `kvflow.bench.spec_prompts` (rewrite, copy, summarize)
  and a few open ones below, applied to passages cut from the shipped text, so there are as many
  as wanted and none is a benchmark's prompt.
- **Held out**: the benchmark's own conversations (`spec_prompts.conversations("chat")` and
  `("grounded")`) with the target's answers, never trained on, so the head's agreement with the
  target on them says what `kvflow bench` will see. `kvflow.bench.datasets` is not used: its
  prompts are random token ids (or the lines of a user's file), nothing a head drafts on.

A sequence's tokens before `answer_start` are a prompt the target did not write: the loss and the
agreement count only pairs whose predicted token lies after it (0: every pair counts).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from kvflow.bench.spec_prompts import PROMPT_SETS, TASKS, conversations
from kvflow.data import english_text
from kvflow.sampling_params import SamplingParams

DATA_FILE = "trainer/data.json"  # in OUT
PASSAGE_WORDS = 90  # a passage of the shipped text in a chat prompt: a paragraph's length
# Open tasks besides spec_prompts' copying ones, so the answers are not all near-copies.
OPEN_TASKS = [
    "Explain in plain modern words what happens in this passage:\n\n{passage}",
    "Write three questions a reader might ask about this passage, and answer each briefly:\n\n{passage}",
    "Who are the people in this passage, and what does each of them do?\n\n{passage}",
]


@dataclass(frozen=True)
class Sequence:
    tokens: list[int]
    answer_start: int = 0  # tokens before it are a prompt the target did not write


@dataclass(frozen=True)
class TrainingData:
    train: list[Sequence]
    held_out: list[Sequence]

    def save(self, out: Path) -> None:
        (out / DATA_FILE).write_text(json.dumps({"train": [asdict(s) for s in self.train],
                                                 "held_out": [asdict(s) for s in self.held_out]}))

    @classmethod
    def load(cls, out: Path) -> TrainingData:
        raw = json.loads((out / DATA_FILE).read_text())
        return cls([Sequence(**s) for s in raw["train"]], [Sequence(**s) for s in raw["held_out"]])


def build_training_data(llm, seq_len: int, text_tokens: int, chat_prompts: int) -> TrainingData:
    """`llm`: a `kvflow.LLM` of the target (its tokenizer and `generate`)."""
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(english_text(), add_special_tokens=False)[:text_tokens]
    text = [Sequence(ids[i:i + seq_len]) for i in range(0, len(ids), seq_len) if len(ids[i:i + seq_len]) >= 2]
    train_chats = [[{"role": "user", "content": task.format(passage=passage)}]
                   for passage, task in zip(_passages(chat_prompts), _tasks(chat_prompts))]
    held_chats = [c for name in PROMPT_SETS for c in conversations(name)]
    answered = _answers(llm, [_prompt(tokenizer, c, seq_len) for c in train_chats + held_chats], seq_len)
    return TrainingData(text + answered[:len(train_chats)], answered[len(train_chats):])


def _passages(count: int) -> list[str]:
    """`count` passages of the shipped text spread evenly over it, each a run of whole words."""
    words = [w for chapter in english_text().split("\n\n") if len(chapter) > 200 for w in chapter.split()]
    starts = range(0, max(len(words) - PASSAGE_WORDS, 1), max((len(words) - PASSAGE_WORDS) // max(count, 1), 1))
    return [" ".join(words[s:s + PASSAGE_WORDS]) for s in starts][:count]


def _tasks(count: int) -> list[str]:
    tasks = TASKS + OPEN_TASKS
    return [tasks[i % len(tasks)] for i in range(count)]


def _prompt(tokenizer, chat: list[dict], seq_len: int) -> list[int]:
    """The chat through the template (a model without one: its text), its end kept if it would
    leave less than half of `seq_len` to the answer."""
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    else:
        ids = tokenizer.encode(chat[-1]["content"])
    return ids[-(seq_len // 2):]


def _answers(llm, prompts: list[list[int]], seq_len: int) -> list[Sequence]:
    """Each prompt and the target's greedy answer, together at most `seq_len` tokens."""
    params = [SamplingParams(temperature=0, max_tokens=seq_len - len(p)) for p in prompts]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    return [Sequence(p + list(out.outputs[0].token_ids), len(p)) for p, out in zip(prompts, outputs)]
