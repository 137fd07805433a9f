"""EAGLE and EAGLE-3 speculation (kvflow.spec_decode.eagle, kvflow.model.models.eagle) with tiny
random heads (tests/eagle_checkpoints.py) over a tiny Llama target, float32:

- the head computes the published formula: its teacher-forced logits equal a plain-torch
  reference written here from the checkpoint's tensors;
- the proposals the engine makes are that reference's greedy chain on the target's features (a
  random head is rejected almost always, so acceptance alone would prove nothing);
- greedy output is the non-speculative output token for token (several prompts, chunked prefill,
  a prefix-cache hit, n > 1, pure decode steps on the fast path);
- the proposals' q is the law they are drawn from: the first token emitted after verification
  follows the target's distribution (the chain's distributional test);
- a checkpoint that does not fit is refused, naming the field.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
from eagle_checkpoints import AUX_LAYER_IDS, TARGET_CONFIG, make_target, write_eagle, write_eagle3
from test_rejection_distribution import _chi_square_p_value

from kvflow import LLM, SamplingParams
from kvflow.core.runner_output import ModelRunnerOutput
from kvflow.core.sched_output import ScheduledChunk
from kvflow.spec_decode.model_proposer import DraftSpan
from kvflow.spec_decode.proposer import DraftRequest

SAMPLES = int(os.environ.get("SAMPLES", 200_000))
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
METHODS = ("eagle", "eagle3")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target = make_target(root / "target")
    tensors = {"eagle": write_eagle(root / "eagle"), "eagle3": write_eagle3(root / "eagle3")}
    return target, str(root / "target"), {m: str(root / m) for m in METHODS}, tensors


def _llm(target_dir: str, spec: dict | None = None, **kw) -> LLM:
    return LLM(target_dir, dtype="float32", skip_tokenizer_init=True, disable_log_stats=True, speculative_config=spec,
               **kw)


def _spec(method: str, head_dir: str, k: int = 3, **kw) -> dict:
    return dict(method=method, model=head_dir, num_speculative_tokens=k, adaptive=False, **kw)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- the reference: the published formulas in plain torch, float32, from the checkpoint's tensors ----
def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + TARGET_CONFIG["rms_norm_eps"])


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] rotated as Llama's (rotate-half) RoPE at `positions`."""
    d = x.shape[-1]
    inv_freq = 1.0 / TARGET_CONFIG["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions[:, None].float() * inv_freq
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + half * sin


def _layer(t: dict, prefix: str, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One Llama layer's attention (causal over all rows, positions 0..) and MLP, without an
    input norm: (MLP output, the residual stream it adds to)."""
    heads, kv_heads = TARGET_CONFIG["num_attention_heads"], TARGET_CONFIG["num_key_value_heads"]
    positions = torch.arange(x.shape[0])
    q = _rope((x @ t[f"{prefix}.self_attn.q_proj.weight"].T).unflatten(-1, (heads, -1)), positions)
    k = _rope((x @ t[f"{prefix}.self_attn.k_proj.weight"].T).unflatten(-1, (kv_heads, -1)), positions)
    v = (x @ t[f"{prefix}.self_attn.v_proj.weight"].T).unflatten(-1, (kv_heads, -1))
    k, v = (z.repeat_interleave(heads // kv_heads, dim=1) for z in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones_like(scores[0], dtype=torch.bool).triu(1), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).flatten(1) @ t[f"{prefix}.self_attn.o_proj.weight"].T
    residual = attended + residual
    h = _rms(residual, t[f"{prefix}.post_attention_layernorm.weight"])
    gate, up = h @ t[f"{prefix}.mlp.gate_proj.weight"].T, h @ t[f"{prefix}.mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ t[f"{prefix}.mlp.down_proj.weight"].T, residual


def reference_head(method: str, t: dict, target, tokens: list[int], features: torch.Tensor):
    """(logits over the target's vocabulary [T, V], the features the head hands on [T, H]) of the
    pairs (features[i], tokens[i]) at positions 0..T-1; EAGLE-3's first-pass rows are 3H wide."""
    embedded = target.model.embed_tokens.weight[torch.tensor(tokens)]
    if method == "eagle":
        x = torch.cat([embedded, torch.stack(list(features))], -1) @ t["fc.weight"].T + t.get("fc.bias", 0)
        out, residual = _layer(t, "layers.0", x, x)
        h = out + residual
        return h @ target.lm_head.weight.T, h
    f = torch.stack([row @ t["fc.weight"].T if row.shape[-1] > embedded.shape[-1] else row for row in features])
    x = torch.cat([_rms(embedded, t["midlayer.input_layernorm.weight"]), _rms(f, t["midlayer.hidden_norm.weight"])], -1)
    out, residual = _layer(t, "midlayer", x, f)
    prenorm = out + residual
    draft = _rms(prenorm, t["norm.weight"]) @ t["lm_head.weight"].T
    logits = torch.full((draft.shape[0], TARGET_CONFIG["vocab_size"]), float("-inf"))
    logits[:, torch.arange(draft.shape[1]) + t["d2t"]] = draft
    return logits, prenorm


def target_features(method: str, target, tokens: list[int]) -> torch.Tensor:
    """The target's states at every position of `tokens` the head reads: its final hidden state
    (EAGLE-1), or the inputs of the layers AUX_LAYER_IDS side by side (EAGLE-3)."""
    with torch.no_grad():
        states = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    if method == "eagle":
        return states[-1][0]
    return torch.cat([states[i][0] for i in AUX_LAYER_IDS], -1)


def _head_runner(llm: LLM):
    return llm.llm_engine.runner.speculator.proposer.runner


# -- the head ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method", [*METHODS, "eagle without fc bias"])
def test_the_head_computes_the_published_formula(dirs, tmp_path, method):
    """EAGLE-1 heads come with an fc bias (EAGLE's own checkpoints) or without (vLLM's, kvflow's
    trainer): both load."""
    target, target_dir, heads, tensors = dirs
    if method == "eagle without fc bias":
        method, tensors = "eagle", {"eagle": write_eagle(tmp_path / "head", fc_bias=False)}
        heads = {"eagle": str(tmp_path / "head")}
    llm = _llm(target_dir, _spec(method, heads[method]), block_size=8)
    runner = _head_runner(llm)
    tokens = _tokens(30, 1)
    features = target_features(method, target, tokens)[:-1]
    with torch.no_grad():
        want, want_fed = reference_head(method, tensors[method], target, tokens[1:], list(features))
        batch = runner._batch([DraftSpan(tokens[1:], 0, ([0, 1, 2, 3],))], [True])
        hidden, fed = runner.model(batch.input_ids, batch.positions, runner.model.combine(features), runner.kv_caches,
                                   batch.attn)
        got = runner.model.compute_logits(hidden)
    assert torch.isfinite(want).sum() == (97 if method == "eagle" else 61) * len(features)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert (got[finite] - want[finite]).abs().max() <= 1e-4 * max(1.0, want[finite].abs().max())
    assert (fed - want_fed).abs().max() <= 1e-4
    assert (runner.model.fc.bias is None) == ("fc.bias" not in tensors[method])


# -- the engine -------------------------------------------------------------------------------
def _record_proposals(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(the request's known tokens, what the proposer proposed) for every greedy proposal."""
    proposer, calls = llm.llm_engine.runner.speculator.proposer, []
    propose = proposer.propose

    def recording(requests: list[DraftRequest], target):
        proposals = propose(requests, target)
        calls.extend((r.token_ids, proposals.token_ids[r.request_id]) for r in requests)
        return proposals

    proposer.propose = recording
    return calls


def _reference_chain(method: str, tensors: dict, target, known: list[int], k: int) -> list[int | None]:
    """The reference head's greedy proposals after `known`, None from the first near tie on."""
    features = list(target_features(method, target, known)[:-1])
    tokens, chain = known[1:], []
    with torch.no_grad():
        for _ in range(k):
            logits, fed = reference_head(method, tensors, target, tokens, features)
            top = logits[-1].topk(2).values
            if top[0] - top[1] < 1e-3:  # a tie is no behaviour: float noise may break it either way
                return chain + [None] * (k - len(chain))
            chain.append(int(logits[-1].argmax()))
            tokens, features = tokens + chain[-1:], features + [fed[-1]]
    return chain


@pytest.mark.parametrize("fast_steps", [False, True], ids=["verifying", "fast decode steps"])
@pytest.mark.parametrize("method", METHODS)
def test_the_engine_proposes_the_reference_heads_greedy_chain(dirs, method, fast_steps):
    """Chunked prompts, then decodes; with `fast_steps` only a request running alone speculates,
    so the head first reads the features of plain decode steps (the CPU decode step's for EAGLE-1,
    the modules' for EAGLE-3)."""
    target, target_dir, heads, tensors = dirs
    k = 3
    spec = _spec(method, heads[method], k=k, **({"disable_by_batch_size": 2} if fast_steps else {}))
    llm = _llm(target_dir, spec, max_num_batched_tokens=24, enable_prefix_caching=False)
    calls = _record_proposals(llm)
    prompts = [_tokens(n, 10 + n) for n in (5, 17, 40)]
    llm.generate(prompts, [GREEDY.clone(max_tokens=n) for n in (6, 8, 24)], use_tqdm=False)
    compared = 0
    for known, proposed in calls:  # the scheduler asks for fewer than k near max_tokens
        want = _reference_chain(method, tensors[method], target, known, len(proposed))
        sure = [w for w in want if w is not None]
        assert proposed[:len(sure)] == sure, (known, proposed, want)
        compared += len(sure)
    proposed_in_all = sum(len(proposed) for _, proposed in calls)
    assert proposed_in_all >= 3 * 2 * k and compared >= 0.9 * proposed_in_all  # near ties are rare


SCENARIOS = {
    "roomy": dict(),
    # Prompt chunks sharing steps with verifications; a pool too small for all: preemption.
    "chunked, preempted": dict(max_num_batched_tokens=13, num_kv_blocks=16, block_size=8),
    # Up to 1 running request speculates: the others decode plainly, on the fast decode step.
    "fast decode steps": dict(spec=dict(disable_by_batch_size=2)),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_is_the_non_speculative_output(dirs, method, scenario):
    _, target_dir, heads, _ = dirs
    settings = dict(SCENARIOS[scenario])
    spec = _spec(method, heads[method], **settings.pop("spec", {}))
    shared = _tokens(24, 5)
    first = [_tokens(n, n) for n in (3, 19, 33, 8)] + [shared + _tokens(6, 6)]
    later = [shared + _tokens(9, 7)]  # a prefix-cache hit on the first batch's last prompt
    params = [GREEDY, GREEDY.clone(max_tokens=9), GREEDY.clone(n=2), GREEDY, GREEDY.clone(max_tokens=25)]

    def run(llm: LLM) -> tuple[list, list]:
        outs = llm.generate(first, params, use_tqdm=False) + llm.generate(later, GREEDY, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outs], [o.num_cached_tokens for o in outs]

    plain, _ = run(_llm(target_dir, block_size=8, **{k: v for k, v in settings.items() if k != "block_size"}))
    llm = _llm(target_dir, spec, block_size=8, **{k: v for k, v in settings.items() if k != "block_size"})
    speculated, cached = run(llm)
    assert speculated == plain
    assert cached[-1] >= 16
    engine = llm.llm_engine
    assert engine.kv_cache_usage == 0.0
    assert engine.get_stats().spec_decoding.num_draft_tokens > 0
    if scenario == "chunked, preempted":
        assert engine.scheduler.num_preemptions_total > 0


# -- sampling ---------------------------------------------------------------------------------
PARAMS = SamplingParams(temperature=0.9, top_k=30, max_tokens=8)


def test_sampled_proposals_keep_the_target_distribution(dirs):
    """SAMPLES copies of one request, each proposing one token through the EAGLE-3 path (the head's
    catch-up logits, q after the request's temperature and top-k, the draw), all verified in one
    call: the emitted first token follows the target's distribution by the chain's test."""
    target, target_dir, heads, _ = dirs
    llm = _llm(target_dir, _spec("eagle3", heads["eagle3"], k=1), block_size=8)
    runner, proposer = llm.llm_engine.runner, llm.llm_engine.runner.speculator.proposer
    context = _tokens(12, 3)
    with torch.no_grad():
        features = target_features("eagle3", target, context)[:-1]
        logits, fed = proposer.runner.forward_features([DraftSpan(context[1:], 0, ([0, 1],))],
                                                       proposer.combine(features), [True])
        p_logits = target(torch.tensor([context])).logits[0, -1]
        after = target(torch.cat([torch.tensor([context] * 97), torch.arange(97)[:, None]], 1)).logits[:, -1]
    requests = [DraftRequest(f"r{i}", context, 1, ([0, 1],), PARAMS, None) for i in range(SAMPLES)]
    proposals = proposer._draft(requests, logits.expand(SAMPLES, -1), fed.expand(SAMPLES, -1))
    drafts = torch.tensor([proposals.token_ids[r.request_id][0] for r in requests])
    chunks = [ScheduledChunk(r.request_id, [context[-1], d], 11, [0, 1], True, PARAMS, context[:11], [], frozenset(),
                             num_spec_tokens=1) for r, d in zip(requests, drafts.tolist())]
    speculator = runner.speculator
    speculator._draft_probs.update(proposals.probs)
    out = ModelRunnerOutput()
    speculator.verify(chunks, torch.stack([p_logits.expand(SAMPLES, -1), after[drafts]], 1).flatten(0, 1),
                      runner._sampling_batch, runner._generator, out)
    first = torch.bincount(torch.tensor([out.sampled[c.request_id][0] for c in chunks]), minlength=97)
    batch = runner._sampling_batch(chunks[:1])
    p = runner.sampler.probs(runner.sampler.adjust(p_logits[None], batch)[0], batch)[0]
    assert 0.5 * (first / first.sum() - p).abs().sum() < 0.01 and _chi_square_p_value(first, p) > 1e-3
    q = proposals.probs["r0"][0]
    assert 0.5 * (q - p).abs().sum() > 0.1  # the head is not the target: rejections did the work
    assert sum(len(out.sampled[c.request_id]) == 1 for c in chunks) > SAMPLES // 10


# -- refusals ---------------------------------------------------------------------------------
def _broken(tmp_path, method: str, change) -> str:
    """A head directory written by `change(directory)`."""
    directory = tmp_path / method
    change(directory)
    return str(directory)


def _without(tensor: str, method: str):
    def change(directory):
        (write_eagle if method == "eagle" else write_eagle3)(directory)
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(directory / "model.safetensors"))
        del tensors[tensor]
        save_file(tensors, str(directory / "model.safetensors"))
    return change


@pytest.mark.parametrize("method, change, message", [
    ("eagle", lambda d: write_eagle(d, hidden_size=32, intermediate_size=48), "head's hidden_size is 32; it must be 64"),
    ("eagle3", lambda d: write_eagle3(d, num_hidden_layers=2), "num_hidden_layers is 2; it must be 1"),
    ("eagle", lambda d: write_eagle(d, vocab_size=61), "vocab_size is 61; it must be 97"),
    ("eagle", _without("layers.0.mlp.down_proj.weight", "eagle"), "missing weights: layers.0.mlp.down_proj.weight"),
    ("eagle3", _without("d2t", "eagle3"), "needs an integer 'd2t'"),
    ("eagle3", lambda d: write_eagle3(d, eagle_aux_hidden_state_layer_ids=[0, 2, 4]),
     "eagle_aux_hidden_state_layer_ids \\[0, 2, 4\\] must name distinct layers of the target's 4"),
    ("eagle", lambda d: (write_eagle(d), shutil.copy(d / "model.safetensors", d / "pytorch_model.bin"),
                         (d / "model.safetensors").unlink()), "only pickled weights"),
])
def test_a_head_that_does_not_fit_is_refused_naming_the_field(dirs, tmp_path, method, change, message):
    _, target_dir, _, _ = dirs
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        _llm(target_dir, _spec(method, _broken(tmp_path, method, change)))


@pytest.mark.parametrize("method", METHODS)
def test_a_missing_model_is_refused_naming_the_field(dirs, method):
    with pytest.raises(ValueError, match="model must be a checkpoint path for methods draft_model, eagle, eagle3"):
        _llm(dirs[1], {"method": method, "num_speculative_tokens": 2})


@pytest.mark.parametrize("method", METHODS)
def test_the_heads_kv_comes_out_of_the_kv_budget(dirs, method):
    """The head's KV sits at the target's block ids, a block of it per target block: a budget holds
    as many blocks as fit the target's KV and the head's together, not the target's alone."""
    budget_gb = 4 / 1024
    plain = _llm(dirs[1], kv_cache_memory_gb=budget_gb, block_size=8).llm_engine
    drafted = _llm(dirs[1], _spec(method, dirs[2][method]), kv_cache_memory_gb=budget_gb, block_size=8).llm_engine
    target_block = plain.arch.kv_layout.block_bytes(8, 4)
    head_block = drafted.runner.speculator.proposer.runner.kv_caches[0][:, :1].nbytes  # K and V of one block
    assert plain.num_kv_blocks == int(budget_gb * 1024**3) // target_block
    assert drafted.num_kv_blocks == int(budget_gb * 1024**3) // (target_block + head_block) < plain.num_kv_blocks


# -- tensor parallel ----------------------------------------------------------------------------
@pytest.mark.timeout(600, method="thread")  # a lost rank must fail the test, not hang it
@pytest.mark.parametrize("method", METHODS)
def test_a_head_sharded_over_two_ranks_proposes_what_one_rank_does(dirs, method):
    """The head shards like a Llama layer under the target's tensor parallel (one KV head a rank)
    and reads the whole features the target's all-reduce made: rank 0's proposals and the
    outputs equal one rank's."""
    _, target_dir, heads, _ = dirs
    prompts = [_tokens(n, 30 + n) for n in (6, 21)]

    def run(tp: int) -> tuple[list, list]:
        llm = _llm(target_dir, _spec(method, heads[method]), tensor_parallel_size=tp, distributed_timeout_s=60,
                   num_kv_blocks=64, block_size=8)
        try:
            calls = _record_proposals(llm)
            outs = llm.generate(prompts, GREEDY.clone(max_tokens=10), use_tqdm=False)
            return [o.outputs[0].token_ids for o in outs], calls
        finally:
            llm.llm_engine.shutdown()

    single, split = run(1), run(2)
    assert split == single and len(single[1]) >= 6


# -- with the other per-request features -------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_grammars_and_seeds_speculate_as_without_a_head(dirs, tmp_path, method):
    """A grammar masks each verified position as it stands after the proposals before it (greedy:
    the plain output, token for token, and a match); a seeded sampled request draws the same
    tokens alone or batched (its proposals and its verification use its own generator)."""
    from kvflow import StructuredOutputsParams
    from kvflow.model.loader.resolve import load_checkpoint

    _, target_dir, heads, _ = dirs
    # A target and heads over the default model's vocabulary, which the grammar library reads.
    tokenizer = load_checkpoint(None, load_tokenizer=True, load_weights=False).tokenizer
    vocab = tokenizer.backend.get_vocab_size()
    make_target(tmp_path / "target", vocab_size=vocab)
    tokenizer.backend.save(str(tmp_path / "target" / "tokenizer.json"))
    (tmp_path / "target" / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    (write_eagle if method == "eagle" else write_eagle3)(tmp_path / "head", vocab_size=vocab)
    regex = r"[a-f]{3}-[0-9]{2,4}\.( [a-z]+){2}"
    constrained = SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=regex))
    prompts = ["Write it: ", "Another one, please: "]

    def texts(spec):
        llm = LLM(str(tmp_path / "target"), dtype="float32", disable_log_stats=True, speculative_config=spec)
        outs = [o.outputs[0].text for o in llm.generate(prompts, constrained, use_tqdm=False)]
        assert spec is None or llm.llm_engine.get_stats().spec_decoding.num_draft_tokens > 0
        return outs

    plain, speculated = texts(None), texts(_spec(method, str(tmp_path / "head")))
    assert speculated == plain and all(re.fullmatch(regex, t) for t in speculated)

    seeded = SamplingParams(temperature=0.8, top_k=40, seed=11, max_tokens=16, ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompt_ids = [_tokens(n, 40 + n) for n in (7, 13, 21)]

    def sampled(prompts_, params):
        llm = _llm(target_dir, _spec(method, heads[method]))
        return [o.outputs[0].token_ids for o in llm.generate(prompts_, params, use_tqdm=False)]

    alone = sampled(prompt_ids[1:2], seeded)[0]
    assert sampled(prompt_ids, [others, seeded, others])[1] == alone
    assert sampled(prompt_ids[1:2], seeded.clone(seed=12))[0] != alone
