"""Multi-token prediction with mixture-of-experts models (DeepSeek-V3's combination) against
Megatron-Core 0.16.1's own GPTModel (local spec, CPU, float64; tests/mtp_workers.py): a depth's
layer is the last decoder layer's kind, MoE or dense, whatever --moe-layer-freq says of its own
number (Megatron-Core gives the depths that layer's spec); megart's weights load strictly under
Megatron-Core's names and give the same main loss, the same depth losses, the same gradient of
every parameter (the depths' routers and experts included) and the same auxiliary losses per
layer in its MoE tracker, the depths' layers numbered after the decoder's. Their auxiliary
losses' gradients are not scaled by the depths' loss factor (only the depths' cross-entropy is).
Megatron-Core's router softmax and tracker are fp32: the losses agree to ~1e-7 relative, the
gradients to ~1e-8 (measured). A depth built dense where Megatron-Core's is MoE, or MoE by its own
number, is refused by Megatron-Core's strict load; depth auxiliary losses scaled by the depths'
factor move the gradients by 3.5e-3 (measured)."""

import pytest

import mtp_moe_workers as mmw
import mtp_workers as mw
from megart.launcher import launch
from megart.models import GPT, GPTConfig

BASE = dict(vocab_size=128, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
            mtp_num_layers=2, num_experts=4, bias=False, moe_aux_loss_coeff=0.01,
            moe_z_loss_coeff=0.001)  # fmt: skip
LLAMA = dict(normalization="rmsnorm", position_embedding="rotary", activation="swiglu",
             ffn_hidden_size=64, untie_embeddings_and_output_weights=True,
             num_query_groups=2)  # fmt: skip
# name: (flags, whether the depths' layers are MoE)
CONFIGS = {
    "every-layer-moe": ({}, True),
    # Layer 3, the first depth's, would be an MoE layer by --moe-layer-freq 2's rule: Megatron-
    # Core's depths take the last decoder layer's (dense) spec.
    "freq-2-last-dense": (dict(moe_layer_freq=2), False),
    "pattern-last-moe-llama-shared": (
        dict(LLAMA, moe_layer_freq=(0, 1), moe_shared_expert_intermediate_size=16),
        True,
    ),
    # DeepSeek-V3's router: sigmoid scores, the expert bias (zero before any update), a top-k
    # scaling factor, group-limited routing; one depth, its own loss factor.
    "sigmoid-expert-bias-groups-one-depth": (
        dict(
            LLAMA,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=2.5,
            mtp_num_layers=1,
            mtp_loss_scaling_factor=0.3,
            moe_shared_expert_intermediate_size=16,
            moe_router_num_groups=2,
            moe_router_group_topk=1,
        ),
        True,
    ),
    # Token dropping: half of each expert's even share, padded to its capacity.
    "capacity-0.5-padded": (
        dict(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True),
        True,
    ),
}


@pytest.fixture(scope="module")
def results():
    configs = [{**BASE, **kw} for kw, _ in CONFIGS.values()]
    plain = launch(mw.compare_all, 1, configs, timeout=300)[0]
    masked = launch(mw.compare_all, 1, configs[:1], 7, timeout=300)[0]
    return {**dict(zip(CONFIGS, plain, strict=True)), "every-layer-moe-masked": masked[0]}


@pytest.mark.parametrize("name", [*CONFIGS, "every-layer-moe-masked"])
def test_moe_depths_match_megatron_core(results, name):
    r = results[name]
    _, depth_moe = CONFIGS[name.removesuffix("-masked")]
    assert all(3 < v < 7 for v in r["depth_values"])
    assert r["mtp_grad"] > 1e-4
    assert r["loss"] < 1e-6
    assert r["depths"] < 1e-5
    assert r["grad"] < 1e-7
    # Each layer's load-balancing and z-loss, the depths' after the decoder's: Megatron-Core's
    # tracker holds num_layers + depths entries, zero for a dense layer.
    assert set(r["aux"]) == set(r["their_aux"]) == {"load_balancing_loss", "z_loss"}
    for name_, ours in r["aux"].items():
        assert ours == pytest.approx(r["their_aux"][name_], rel=1e-6, abs=1e-12)
        depths = ours[BASE["num_layers"] :]
        assert all(v > 0.5 for v in depths) if depth_moe else all(v == 0 for v in depths)
    assert (r["router_grad"] > 1e-5) == depth_moe


def test_the_depths_take_the_last_decoder_layers_kind():
    kinds = {}
    for freq in (1, 2, (0, 1), (1, 0)):
        model = GPT(GPTConfig(**{**BASE, "moe_layer_freq": freq}))
        kinds[freq] = [
            type(layer.transformer_layer.mlp).__name__ for layer in model.chunk.mtp.layers
        ]
    assert kinds == {1: ["MoE"] * 2, 2: ["MLP"] * 2, (0, 1): ["MoE"] * 2, (1, 0): ["MLP"] * 2}
    names = {n for n, _ in GPT(GPTConfig(**BASE)).chunk.named_parameters()}
    assert {"mtp.layers.1.transformer_layer.mlp.router.weight",
            "mtp.layers.1.transformer_layer.mlp.experts.3.proj.weight"} <= names  # fmt: skip


@pytest.mark.parametrize(
    "mistake, kw",
    [
        ("depths-dense", {}),
        ("depths-by-number", dict(moe_layer_freq=2)),
        ("depth-aux-scaled", {}),
    ],
)
def test_a_mistaken_depth_is_caught(mistake, kw):
    r = launch(mmw.compare_mistaken, 1, {**BASE, **kw}, mistake, timeout=300)[0]
    if mistake == "depth-aux-scaled":  # the same layers and losses, other gradients
        assert r["loss"] < 1e-6 and r["depths"] < 1e-5
        assert r["grad"] > 1e-4
    else:  # other layers: Megatron-Core's strict load refuses megart's weights
        assert "Missing key(s)" in r["refused"]
        assert "mtp.layers.0.transformer_layer.mlp.router.weight" in r["refused"]


def test_moe_depth_flops_equal_torchs_counter_but_the_routers():
    """torch's counter over a forward and backward (test_flops.torch_count) counts the routers'
    products too, which megart leaves out as Megatron-LM does: 2 h E a token and MoE layer,
    three passes, the depths' MoE layers included."""
    from megart.training.flops import model_flops
    from test_flops import torch_count

    for freq, moe_layers in ((1, 2 + 2), (2, 1)):
        kw = dict(num_experts=4, moe_layer_freq=freq, mtp_num_layers=2,
                  position_embedding="rotary", bias=False)  # fmt: skip
        cfg, counted = torch_count(layers=2, **kw)
        routers = 3 * 2 * (3 * 16) * cfg.hidden_size * 4 * moe_layers
        assert model_flops(cfg, 3, causal=False) + routers == counted
