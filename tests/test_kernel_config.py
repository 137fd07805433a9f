"""The engine arguments that choose kernels and weight layouts (config.KernelConfig): named like
vLLM's where it has the knob, checked by name, carried to the worker, which builds the model in
them (cpu_extension.kernel_scope) so that its layers keep them."""

from __future__ import annotations

import pytest
import torch

from kvflow.config import EngineArgs, KernelConfig
from kvflow.cpu_extension import current_kernels, kernel_scope
from kvflow.entrypoints.cli import build_parser
from kvflow.model.layers.linear import ReplicatedLinear
from kvflow.model.layers.mlp import GatedMLP
from kvflow.model.layers.norm import RMSNorm
from kvflow.model.layers.rotary import RotaryEmbedding


def test_defaults_are_what_users_run():
    assert EngineArgs().create_config(512).kernels == KernelConfig(custom_ops=True, decode_step=True,
                                                                    weight_layouts="fast")


@pytest.mark.parametrize("args, field", [(dict(custom_ops="fast"), "custom_ops must be all or none"),
                                         (dict(cpu_weight_layouts="small"), "cpu_weight_layouts must be fast or compact")])
def test_a_bad_value_is_refused_by_name(args, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(**args).create_config(512)


def test_flags_reach_the_kernel_config():
    args = build_parser().parse_args(["generate", "hi", "--custom-ops", "none", "--cpu-weight-layouts", "compact",
                                      "--enforce-eager"])
    assert EngineArgs.from_cli_args(args).create_config(512).kernels == KernelConfig(False, False, "compact")


def test_layers_keep_the_choices_in_scope_when_they_are_built():
    with kernel_scope(KernelConfig(custom_ops=False, weight_layouts="compact")):
        norm, rope, mlp = RMSNorm(8, 1e-6), RotaryEmbedding(8, 16, 10000.0, None), GatedMLP(8, 16, None, "mlp")
        linear = ReplicatedLinear(8, 8)
    assert current_kernels() == KernelConfig()  # the scope ends with the block
    assert not norm.custom_ops and not rope(torch.arange(2)).custom_ops and not mlp.fused_silu
    assert linear.kernels.weight_layouts == "compact"
    assert RMSNorm(8, 1e-6).custom_ops and GatedMLP(8, 16, None, "mlp").fused_silu
