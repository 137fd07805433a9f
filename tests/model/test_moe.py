"""The mixture-of-experts layer: routing rules, and grouped execution against a per-token loop."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvflow.model.arch_config import MoEConfig
from kvflow.model.layers.moe import SparseMoE, route

MOE = MoEConfig(num_experts=6, experts_per_token=2, expert_intermediate_size=8, renormalize=True, scoring="softmax",
                topk_method="greedy", routed_scaling_factor=1.0, num_groups=1, topk_groups=1, num_shared_experts=1,
                dense_layers=())


def _moe(config: MoEConfig = MOE, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    layer = SparseMoE(16, config, None, "mlp")
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    return layer


def per_token_reference(layer: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Each token alone: its k experts one by one, weighted, plus the shared experts."""
    rows = []
    for token in x:
        weights, ids = route(layer.gate(token[None]), layer.moe, getattr(layer.gate, "e_score_correction_bias", None))
        out = sum(w * layer.experts[e](token[None])[0] for w, e in zip(weights[0].tolist(), ids[0].tolist()))
        rows.append(out + layer.shared_experts(token[None])[0])
    return torch.stack(rows)


def test_ties_go_to_the_lower_expert_and_weights_follow_the_rules():
    logits = torch.tensor([[0.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    weights, ids = route(logits, MOE)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.5]]))
    plain = route(logits, replace(MOE, renormalize=False, routed_scaling_factor=2.0))[0]
    torch.testing.assert_close(plain, 2.0 * logits.softmax(-1)[:, [1, 2]])


def test_group_limited_routing_picks_experts_only_from_the_best_groups():
    config = replace(MOE, topk_method="group_limited_greedy", num_groups=3, topk_groups=1)
    logits = torch.tensor([[3.0, 0.0, 2.9, 2.8, 0.0, 0.0]])  # groups {0,1}, {2,3}, {4,5}: best expert in group 0
    assert route(logits, config)[1].tolist() == [[0, 1]]
    v3 = replace(config, scoring="sigmoid", topk_method="noaux_tc")  # groups score by their two best
    assert route(logits, v3)[1].tolist() == [[2, 3]]
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 5.0, 5.0])  # steers the choice, not the weights
    weights, ids = route(logits, v3, bias)
    assert ids.tolist() == [[4, 5]]
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.5]]))


def test_grouped_experts_equal_a_per_token_loop_even_with_idle_experts():
    layer = _moe()
    x = torch.randn(9, 16)
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[0, 0], layer.gate.weight[3, 1] = 10.0, 10.0  # experts 1, 2, 4, 5 idle for most tokens
        x[:, 0], x[:, 1] = 1.0, 1.0
        weights, ids = route(layer.gate(x), layer.moe)
        assert set(ids.flatten().tolist()) < set(range(6))
        torch.testing.assert_close(layer(x), per_token_reference(layer, x), atol=1e-5, rtol=0)
        x = torch.randn(9, 16)
        torch.testing.assert_close(layer(x), per_token_reference(layer, x), atol=1e-5, rtol=0)


def test_a_tokens_output_does_not_depend_on_its_batch():
    """No capacity limit, no token dropped: a token gets the same experts and, up to the float
    rounding of a differently sized matmul, the same output alone, in a batch, in any order."""
    layer = _moe(seed=1)
    x = torch.randn(12, 16)
    with torch.no_grad():
        assert torch.equal(route(layer.gate(x), layer.moe)[1],
                           torch.cat([route(layer.gate(x[i:i + 1]), layer.moe)[1] for i in range(12)]))
        together = layer(x)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(12)])
        reordered = layer(x.flip(0)).flip(0)
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together, reordered, atol=1e-5, rtol=1e-5)
