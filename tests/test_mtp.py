"""Multi-token prediction (--mtp-num-layers, models.mtp) against Megatron-Core 0.16.1's own
GPTModel with mtp_num_layers (local spec, CPU, float64; tests/mtp_workers.py): megart's weights
loaded strictly under Megatron-Core's names give the same main loss, the same loss at each
depth (its MTPLossLoggingHelper's) and the same gradient of every parameter, the depths' losses
added through the backward at --mtp-loss-scaling-factor / D. Megatron-Core computes its loss in
fp32, so the losses agree to ~1e-7 where the gradients agree to ~5e-9 (measured). A depth that
concatenates its inputs the other way round, or labels not shifted by the depth, moves the
depth losses by 0.09 to 0.4 and the gradients by 0.013 (tried once each)."""

import pytest

import mtp_workers as mw
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models import GPT, GPTConfig

# A vocabulary of 128: no padding, whose rows Megatron-Core's loss would count.
BASE = dict(vocab_size=128, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
            mtp_num_layers=2)  # fmt: skip
LLAMA = dict(normalization="rmsnorm", position_embedding="rotary", activation="swiglu",
             ffn_hidden_size=64, bias=False, untie_embeddings_and_output_weights=True,
             num_query_groups=2)  # fmt: skip
CONFIGS = {
    "gpt2-two-depths": {},
    "llama-two-depths-untied": LLAMA,
    "gpt2-one-depth-factor-0.3": dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.3),
}


@pytest.fixture(scope="module")
def results():
    configs = [{**BASE, **kw} for kw in CONFIGS.values()]
    plain = launch(mw.compare_all, 1, configs, timeout=300)[0]
    masked = launch(mw.compare_all, 1, configs[:2], 7, timeout=300)[0]
    return {**dict(zip(CONFIGS, plain, strict=True)),
            **{f"{n}-masked": r for n, r in zip(CONFIGS, masked, strict=False)}}  # fmt: skip


@pytest.mark.parametrize("name", [*CONFIGS, *(f"{n}-masked" for n in list(CONFIGS)[:2])])
def test_mtp_loss_depths_and_gradients_match_megatron_core(results, name):
    r = results[name]
    assert all(3 < v < 7 for v in r["depth_values"])  # losses of an untrained model
    assert r["mtp_grad"] > 1e-4  # the depths' weights do learn
    assert r["loss"] < 1e-6
    assert r["depths"] < 1e-5
    assert r["grad"] < 1e-7


def test_mtp_leaves_the_main_loss_and_logits_alone():
    import torch

    cfg = GPTConfig(**BASE)
    plain = GPTConfig(**{**BASE, "mtp_num_layers": None})
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    model, other = GPT(cfg), GPT(plain)
    other.chunk.load_state_dict(
        {k: v for k, v in model.chunk.state_dict().items() if not k.startswith("mtp.")}
    )
    assert (
        model(tokens[:, :-1], tokens[:, 1:]).item() == other(tokens[:, :-1], tokens[:, 1:]).item()
    )
    assert torch.equal(model(tokens[:, :-1]), other(tokens[:, :-1]))
    names = {n for n, _ in model.chunk.named_parameters() if n.startswith("mtp.")}
    assert "mtp.layers.1.eh_proj.weight" in names and "mtp.layers.0.hnorm.weight" in names
    assert model.chunk.mtp.layers[0].eh_proj.weight.shape == (32, 64)  # 2h -> h


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(mtp_num_layers=0), "1 or more"),
        (dict(window_size=(4, 0)), "--window-size"),
        (dict(recompute_granularity="full", recompute_num_layers=2), "--recompute-num-layers 1"),
    ],
)
def test_mtp_config_refusals(kw, words):
    with pytest.raises(ConfigError, match=words):
        GPTConfig(**{**BASE, **kw})


def test_mtp_with_learned_positions_refuses_a_pipeline():
    with pytest.raises(ConfigError, match="rotary positions"):
        GPTConfig(**BASE).check_layout(pp=2)
    GPTConfig(**{**BASE, "position_embedding": "rotary"}).check_layout(pp=2)


@pytest.mark.parametrize(
    "kw",
    [{}, dict(mtp_num_layers=1, activation="swiglu", recompute_granularity="full")],
    ids=["two-depths", "one-depth-swiglu-recomputed"],
)
def test_mtp_flops_equal_torchs_flop_counter(kw):
    """torch's counter over a real forward and backward with the depths (test_flops's
    torch_count): megart's count of them is every product that runs."""
    from megart.training.flops import model_flops
    from test_flops import torch_count

    cfg, counted = torch_count(
        layers=2, **{"position_embedding": "rotary", "mtp_num_layers": 2, **kw}
    )
    plain, _ = torch_count(layers=2, position_embedding="rotary")
    assert model_flops(cfg, 3, cfg.recompute_granularity == "full", causal=False) == counted
    assert counted > model_flops(plain, 3, causal=False)


def test_mtp_flops_are_megatrons_but_the_norms():
    """Megatron-LM's num_floating_point_operations with --mtp-num-layers (facts from its
    training.py): the depths as D more dense layers, 3 passes x 2 FLOPs x (3h + 2h^2) per token
    and depth for the norms and eh_proj, and D + 1 logits; megart leaves the norms' 3h out."""
    from megart.training.flops import iteration_flops, model_flops

    b, s, h, l, d, v = 4, 16, 32, 2, 3, 128
    cfg = GPTConfig(**{**BASE, "mtp_num_layers": d})
    megatron = (
        iteration_flops(b, s, l + d, h, v)
        + 6 * b * s * d * (3 * h + 2 * h * h)
        + d * 6 * b * s * h * v
    )
    assert model_flops(cfg, b) == megatron - 18 * b * s * h * d


TRAIN = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
             micro_batch_size=2, global_batch_size=4, position_embedding_type="rope",
             mtp_num_layers=1)  # fmt: skip


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(calculate_per_token_loss=True), "--calculate-per-token-loss"),
        # Megatron-LM's formats take the depths on one pipeline stage, MoE depths without the
        # distributed optimizer (once refused outright: test_megatron_mtp_ckpt and
        # test_megatron_mtp_moe_ckpt have them).
        (
            dict(ckpt_format="torch", pipeline_model_parallel_size=2),
            r"Megatron-LM's checkpoints \(--ckpt-format torch\) on one pipeline stage",
        ),
        (
            dict(
                ckpt_format="torch_dist",
                num_experts=2,
                disable_bias_linear=True,
                use_distributed_optimizer=True,
            ),
            r"experts \(--num-experts 2\) with --use-distributed-optimizer",
        ),
    ],
)
def test_megart_train_refuses_what_its_depths_are_not_built_for(kw, words):
    from megart.training.config import TrainConfig
    from megart.training.config_checks import check_config

    with pytest.raises(ConfigError, match=words):
        check_config(TrainConfig(**{**TRAIN, **kw}), 2)
    check_config(TrainConfig(**TRAIN), 2)  # the same run without it trains
    for fmt in ("torch", "torch_dist"):  # and in Megatron-LM's formats on one stage
        check_config(TrainConfig(**TRAIN, ckpt_format=fmt), 2)


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_megart_train_takes_the_depths_under_context_parallelism(comm):
    """Refused until the depths shifted along the whole sequence (models.mtp_sequence; their
    runs: tests/test_mtp_mla_cp.py)."""
    from megart.training.config import TrainConfig
    from megart.training.config_checks import check_config

    check_config(TrainConfig(**TRAIN, context_parallel_size=2, cp_comm_type=comm), 2)


def test_megatron_and_hugging_face_formats_refuse_the_depths(tmp_path):
    from megart.training.megatron_args import config_from_args

    model = GPT(GPTConfig(**{**BASE, "position_embedding": "rotary"}))
    with pytest.raises(ConfigError, match="Hugging Face's formats"):
        model.save_hf(str(tmp_path / "hf"))
    args = dict(seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
                vocab_size=128, mtp_num_layers=1)  # fmt: skip
    # Megatron-LM's args now read back with their depths (test_megatron_mtp_ckpt), but on
    # more than one pipeline stage.
    assert config_from_args(args).mtp_num_layers == 1
    with pytest.raises(ConfigError, match="--mtp-num-layers 1.* on 2 pipeline stages"):
        config_from_args({**args, "pipeline_model_parallel_size": 2})
    assert config_from_args({**args, "mtp_num_layers": None}).mtp_num_layers is None


def test_converting_a_checkpoint_with_depths_to_megatron_stages_is_refused(tmp_path):
    """On one pipeline stage it converts (test_megatron_mtp_ckpt), on two it is refused."""
    import train_workers as tw
    from megart.training.megatron_checkpoint import megart_to_megatron

    launch(tw.train_kw, 1, dict(TRAIN, train_iters=1, save=str(tmp_path / "ckpt")), timeout=300)
    with pytest.raises(ConfigError, match=r"--ckpt-format torch_dist\) on one pipeline stage"):
        megart_to_megatron(tmp_path / "ckpt", tmp_path / "out", pp=2, ckpt_format="torch_dist")
    assert megart_to_megatron(tmp_path / "ckpt", tmp_path / "out", ckpt_format="torch_dist")


def test_use_checkpoint_args_takes_the_depths_from_the_checkpoint(tmp_path):
    """As Megatron-LM's --use-checkpoint-args forces --mtp-num-layers from its checkpoint."""
    import train_workers as tw
    from test_hf_llama import train_config

    launch(tw.train_kw, 1, dict(TRAIN, train_iters=1, save=str(tmp_path)), timeout=300)
    argv = ["--load", str(tmp_path), "--use-checkpoint-args", "--train-iters", "2"]
    assert train_config(argv).mtp_num_layers == 1
    assert train_config([*argv, "--mtp-num-layers", "3"]).mtp_num_layers == 1
