"""Prompt sets for measuring speculative decoding, as chat conversations.

- "grounded": rewrite or summarize a passage given in the prompt. The answer reuses the
  passage's words, which is what prompt lookup (n-gram) proposals bet on.
- "chat": short open questions, answered from the model alone (self-speculation's case).

The passages were written for kvflow; they are plain, factual and about nothing in particular.
"""

from __future__ import annotations

PASSAGES = [
    "The lighthouse stood on a low island of grey rock, two miles from the harbour. Its keeper climbed "
    "the spiral stair every evening at sunset to light the lamp, and every morning at dawn to put it out. "
    "In winter the storms came from the west and threw spray over the gallery, and the keeper wrote the "
    "height of the waves in a thick blue logbook. Supply boats came once a week when the sea allowed it, "
    "bringing bread, oil, letters and newspapers that were already a week old.",
    "To repot a houseplant, water it the day before so the roots slide out of the old pot in one piece. "
    "Choose a new pot only a little wider than the old one, with a hole in the bottom for drainage. Put a "
    "layer of fresh soil in the new pot, set the plant on it at the same depth as before, and fill the "
    "gaps around the roots with more soil, pressing it down gently. Water it well and keep it out of "
    "direct sun for a week while the roots settle.",
    "The town library opens at nine in the morning from Monday to Saturday and closes at six in the "
    "evening, except on Thursdays, when it stays open until eight. Members may borrow up to ten books at a "
    "time for three weeks, and renew them twice if nobody else has reserved them. Late returns cost ten "
    "cents a day per book. The reading room on the first floor has newspapers, magazines and a quiet area "
    "with desks that can be booked for two hours at a time.",
    "A bicycle chain needs cleaning when it looks black and gritty or makes a grinding noise. Shift to the "
    "smallest rear cog, hold a rag around the chain and turn the pedals backwards so the chain runs "
    "through the rag. Then put one drop of chain oil on each roller while turning the pedals slowly, wait "
    "a few minutes for the oil to soak in, and wipe off what is left on the outside. Too much oil only "
    "collects more dirt.",
]

TASKS = [
    "Rewrite the following text, keeping every sentence but replacing the word 'the' with 'this' where it "
    "makes sense:\n\n{passage}",
    "Copy the following text exactly, then add one sentence at the end:\n\n{passage}",
    "Summarize the following text in three sentences, reusing its own words:\n\n{passage}",
]

QUESTIONS = [
    "What is the difference between weather and climate?",
    "Give me three tips for learning to play the guitar.",
    "Explain how a refrigerator keeps food cold.",
    "Why do leaves change colour in autumn?",
    "Write a short story about a cat who finds a key.",
    "What should I pack for a weekend hiking trip?",
]

PROMPT_SETS = ("grounded", "chat")


def conversations(name: str) -> list[list[dict]]:
    if name == "grounded":
        return [[{"role": "user", "content": task.format(passage=passage)}]
                for passage in PASSAGES for task in TASKS]
    if name == "chat":
        return [[{"role": "user", "content": question}] for question in QUESTIONS]
    raise ValueError(f"prompt set must be one of {', '.join(PROMPT_SETS)}; got {name!r}")


def chat_prompt_ids(tokenizer, name: str, num_prompts: int) -> list[list[int]]:
    """`num_prompts` prompts of the set, in order and repeated, through the chat template."""
    chats = conversations(name)
    return [tokenizer.apply_chat_template(chats[i % len(chats)], add_generation_prompt=True, tokenize=True)
            for i in range(num_prompts)]
