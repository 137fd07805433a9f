"""Does a request's greedy output depend on what runs beside it? The default model (bf16), with
and without `--batch-invariant`.

    PYTHONPATH=src .venv/bin/python benchmarks/batch_invariance.py [--num-prompts 16] [--output-len 64]

Each of N chat prompts is generated alone (batch 1), then all N together (one engine, continuous
batching, a small token budget so prompts are chunked beside decodes). Counted per mode: requests
whose tokens differ between the two runs, and requests whose tokens agree but whose logprobs differ
in any bit. The speed cost of the mode is measured by `kvflow bench latency` / `bench throughput`
with `--batch-invariant` (docs/performance-journal.md).
"""

from __future__ import annotations

import argparse

from kvflow import LLM, SamplingParams
from kvflow.bench.spec_prompts import chat_prompt_ids


def outputs(llm: LLM, prompts: list, params: SamplingParams) -> list[tuple]:
    results = llm.generate(prompts, params, use_tqdm=False)
    return [(tuple(r.outputs[0].token_ids), tuple(lp[t].logprob for lp, t in zip(r.outputs[0].logprobs,
                                                                               r.outputs[0].token_ids)))
            for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, logprobs=0, ignore_eos=True)
    for invariant in (False, True):
        llm = LLM(dtype="bfloat16", max_num_batched_tokens=256, batch_invariant=invariant)
        prompts = [{"prompt_token_ids": ids} for ids in chat_prompt_ids(llm.get_tokenizer(), "chat", args.num_prompts)]
        alone = [outputs(llm, [p], params)[0] for p in prompts]
        together = outputs(llm, prompts, params)
        tokens_differ = sum(a[0] != b[0] for a, b in zip(alone, together))
        bits_differ = sum(a[0] == b[0] and a[1] != b[1] for a, b in zip(alone, together))
        print(f"batch_invariant={invariant}: of {len(prompts)} requests, {tokens_differ} generated other tokens "
              f"in the batch than alone; {bits_differ} more had the same tokens with other logprobs")


if __name__ == "__main__":
    main()
