"""megart's mixture-of-experts models in Megatron-LM's checkpoints: the MoE flags in its args
as Megatron-LM 0.16 records them (and read back, older args meaning a dense model),
--use-checkpoint-args' MoE flags, the loads' refusal of another architecture naming the MoE
flag, Megatron-LM's legacy files (--ckpt-format torch) that Megatron-Core 0.16.1's own MoE
GPTModel loads strictly at pp1 and pp2 with megart's logits and that megart resumes from
(torch_dist: test_megatron_dist_moe)."""

import dataclasses
import shutil

import pytest
import torch

import megatron_workers as mw
from megart import ConfigError
from megart.cli.main import main as megart_main
from megart.launcher import launch
from megart.models import GPTConfig
from megart.training.megatron_args import (
    check_args,
    config_from_args,
    megatron_args,
)
from megart.training.megatron_files import torch_load
from test_checkpoint_args import USE, flags_config, strip_megart_record

MOE = dict(vocab_size=100, seq_length=8, hidden_size=16, num_layers=4, num_attention_heads=2,
           ffn_hidden_size=64,
           bias=False, activation="swiglu", num_experts=3, moe_layer_freq=(1, 0, 1, 1),
           moe_router_topk=2, moe_ffn_hidden_size=24, moe_router_score_function="sigmoid",
           moe_router_topk_scaling_factor=2.0, moe_router_dtype="fp64",
           moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)  # fmt: skip
# megart train's flags of a small MoE model (every other layer MoE) with both losses.
FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--eval-iters", "0", "--disable-bias-linear", "--swiglu", "--hidden-dropout", "0",
         "--attention-dropout", "0"]  # fmt: skip
EXPERTS = ["--num-experts", "4", "--moe-layer-freq", "2", "--moe-router-pre-softmax",
           "--moe-router-topk", "1", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff",
           "0.001", "--moe-router-dtype", "fp32"]  # fmt: skip


def test_args_hold_the_moe_flags_as_megatron_016_records_them_and_read_back():
    cfg = GPTConfig(**MOE)
    a = vars(megatron_args(cfg, 3))
    assert a["num_experts"] == 3 and a["moe_ffn_hidden_size"] == 24
    assert a["moe_layer_freq"] == [1, 0, 1, 1]  # moe_freq_type's list
    assert (a["moe_router_topk"], a["moe_router_score_function"]) == (2, "sigmoid")
    assert (a["moe_router_topk_scaling_factor"], a["moe_router_dtype"]) == (2.0, "fp64")
    assert (a["moe_router_load_balancing_type"], a["moe_aux_loss_coeff"]) == ("aux_loss", 0.01)
    assert (a["expert_model_parallel_size"], a["moe_grouped_gemm"]) == (1, False)
    assert config_from_args(a) == cfg
    # The experts' width where not given: --ffn-hidden-size's, written out as validate_args
    # fills it in, read back as megart's None.
    wide = GPTConfig(**{**MOE, "moe_ffn_hidden_size": None, "ffn_hidden_size": 40})
    assert vars(megatron_args(wide, 0))["moe_ffn_hidden_size"] == 40
    assert config_from_args(vars(megatron_args(wide, 0))) == wide
    dense = vars(megatron_args(GPTConfig(**{**MOE, "num_experts": None, **_defaults()}), 0))
    assert (dense["num_experts"], dense["moe_ffn_hidden_size"]) == (None, None)


def _defaults() -> dict:
    from megart.models.moe_checks import MOE_DEFAULTS

    return dict(MOE_DEFAULTS)


def test_megatron_written_and_older_args():
    a = vars(megatron_args(GPTConfig(**MOE), 0))
    # As Megatron's argparse gives the nargs "+" flags before validate_args: lists of one.
    listed = {**a, "moe_router_load_balancing_type": ["none"], "moe_aux_loss_coeff": [0.0]}
    cfg = config_from_args(listed)
    assert (cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff) == ("none", 0.0)
    # --num-experts 0 (validate_args makes it None) and args from before Megatron had experts.
    older = {k: v for k, v in a.items() if "expert" not in k and not k.startswith("moe_")}
    for args in ({**a, "num_experts": 0}, {**a, "num_experts": None}, older):
        assert config_from_args(args).num_experts is None
    # (Shared experts, once here, are read: test_megatron_shared_experts_ckpt.)
    with pytest.raises(ConfigError, match="saved with --moe-grouped-gemm.*megart does not have"):
        check_args({**a, "moe_grouped_gemm": True}, "ckpt")
    # Expert parallelism: legacy files (megatron_expert_files) and torch_dist stores are read
    # (test_megatron_dist_ep: its distributed optimizer's state is refused where it is read).
    spread = {**a, "expert_model_parallel_size": 2}
    check_args(spread, "ckpt")
    check_args(a, "ckpt")  # megart's own: taken


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    """A pp2 MoE run's Megatron legacy files after 1 of 3 iterations, and the run's curve."""
    root = tmp_path_factory.mktemp("moe")
    pp2 = [*FLAGS, *EXPERTS, "--pipeline-model-parallel-size", "2", "--train-iters", "3"]
    straight = launch(mw.run_cli, 2, pp2, timeout=400)[0]
    assert straight[0] == 0, straight[1]
    ckpt = root / "ckpt"
    saved = [*pp2, "--exit-interval", "1", "--ckpt-format", "torch", "--save", str(ckpt)]
    assert launch(mw.run_cli, 2, saved, timeout=400)[0][0] == 0
    return root, ckpt, straight[1]


def _losses(out: str) -> list[str]:
    return [
        line.split("| loss ")[1].split(" ")[0] for line in out.splitlines() if "| loss " in line
    ]


def test_megart_resumes_its_moe_legacy_files_on_the_curve(legacy):
    root, ckpt, straight = legacy
    argv = [*FLAGS, *EXPERTS, "--train-iters", "3", "--load", str(ckpt)]
    resumed = launch(mw.run_cli, 2, [*argv, "--pipeline-model-parallel-size", "2"], timeout=400)
    assert resumed[0][0] == 0, resumed[0][1]
    assert _losses(resumed[0][1]) == _losses(straight)[1:]  # printed to 4 digits
    # The files' optimizer is Megatron's (experts in its named_parameters order).
    state = torch_load(ckpt / "iter_0000001" / "mp_rank_00_000" / "model_optim_rng.pt")
    names = list(state["model"])
    assert names.index("decoder.layers.0.mlp.router.weight") < names.index(
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"
    )
    assert len(state["optimizer"]["param_groups"]) == 2  # fp32: torch's state dict


def test_use_checkpoint_args_takes_the_moe_flags_from_megatron_files(legacy, capsys):
    root, ckpt, _ = legacy
    copy = root / "stripped"
    shutil.copytree(ckpt, copy)
    strip_megart_record(copy)
    run = ["--load", str(copy), *USE, "--micro-batch-size", "2", "--global-batch-size", "4"]
    want = flags_config([*FLAGS, *EXPERTS]).gpt_config()
    got = flags_config([*run, "--moe-router-topk", "3"])
    printed = capsys.readouterr().out
    assert "Setting moe_router_topk to 1 from checkpoint (overriding the command line's " in (
        printed
    )
    # Megatron-LM takes the architecture; the training losses stay the command line's.
    assert got.num_experts == 4 and got.moe_layer_freq == "2" and got.moe_router_pre_softmax
    assert (got.moe_aux_loss_coeff, got.moe_z_loss_coeff) == (0.0, None)
    assert got.moe_router_dtype == "fp32"  # megart's: where the command line gives none
    cfg = flags_config([*run, "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"])
    assert cfg.gpt_config() == want
    trained = dataclasses.replace(want, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
    assert got.gpt_config() == trained


def test_loads_refuse_another_architecture_naming_the_moe_flag(tmp_path):
    def run(argv: list[str]) -> tuple[int, str]:
        return launch(mw.run_cli, 1, [*FLAGS, "--train-iters", "2", *argv], timeout=300)[0]

    dense = tmp_path / "dense"
    assert run(["--exit-interval", "1", "--save", str(dense)])[0] == 0
    status, out = run([*EXPERTS, "--load", str(dense)])
    assert status != 0 and "saved with no --num-experts (now --num-experts 4)" in out
    assert "--moe-router-topk" not in out  # the dense model has none: one flag named
    moe = tmp_path / "moe"
    assert (
        run([*EXPERTS, "--exit-interval", "1", "--ckpt-format", "torch", "--save", str(moe)])[0]
        == 0
    )
    other = ["--moe-layer-freq", "[1,1,0,0]", "--moe-router-topk", "2", "--load", str(moe)]
    status, out = run([*EXPERTS, *other])
    assert status != 0
    assert "--moe-layer-freq [1, 0, 1, 0] (now --moe-layer-freq [1, 1, 0, 0])" in out
    assert "--moe-router-topk 1 (now --moe-router-topk 2)" in out
    # The same layers given as a pattern, another router dtype and losses: the same model.
    same = ["--moe-layer-freq", "[1,0,1,0]", "--moe-router-dtype", "fp64",
            "--moe-aux-loss-coeff", "0", "--load", str(moe)]  # fmt: skip
    status, out = run([*EXPERTS, *same])
    assert status == 0, out


def megatron_core_logits(megatron_dir: str, kw: dict) -> dict:
    """Megatron-Core's one-rank MoE GPTModel, built from the legacy files' args, loading them
    strictly; its logits next to megart's GPT of the files' weights (megart's reader)."""
    import megatron_core_workers as mcw
    from megart.models import GPT
    from megart.training.megatron_checkpoint import megatron_weights, read_megatron

    cfg, model, _ = read_megatron(megatron_dir)
    theirs = mcw.megatron_model(cfg)
    extra = {k: v for k, v in theirs.state_dict().items() if k.endswith("_extra_state")}
    theirs.load_state_dict({**model, **extra}, strict=True)
    _, weights, _ = megatron_weights(megatron_dir)
    ours = GPT(cfg)
    ours.chunk.load_state_dict(weights, strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                           generator=torch.Generator().manual_seed(5))  # fmt: skip
    with torch.no_grad():
        want = ours.double()(tokens)
    got = mcw.megatron_logits(theirs, tokens)[..., : want.shape[-1]]
    return dict(logits=(got - want).abs().max().item(), scale=want.abs().max().item(),
                experts=cfg.num_experts)  # fmt: skip


def test_megatron_core_loads_megarts_moe_legacy_files_with_its_logits(legacy, tmp_path):
    """pp1: megart train's files merged by convert-checkpoint --to megart and written again
    for one rank; pp2: the pp2 run's own files, each rank's stages in Megatron-Core (the
    mcore-pp2 sweep's stage_logits). Bound 1e-6: Megatron-Core's routing rounds to fp32."""
    import sweep_mcore_pp

    root, ckpt, _ = legacy
    back, one = tmp_path / "back", tmp_path / "one"
    assert megart_main(["convert-checkpoint", "--from", "megatron", "--to", "megart", "--load",
                        str(ckpt), "--save", str(back)]) == 0  # fmt: skip
    assert megart_main(["convert-checkpoint", "--from", "megart", "--to", "megatron", "--load",
                        str(back), "--save", str(one), "--target-pipeline-parallel-size",
                        "1"]) == 0  # fmt: skip
    r = launch(megatron_core_logits, 1, str(one), {}, timeout=300)[0]
    assert r["experts"] == 4 and r["scale"] > 0.1 and r["logits"] < 1e-6
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    got = [g for g in launch(sweep_mcore_pp.stage_logits, 2, str(ckpt), tokens, timeout=300) if
           g is not None]  # fmt: skip
    import megatron_core_ckpt_workers as mckw

    want = launch(mckw.checkpoint_logits, 1, str(back), tokens, timeout=300)[0]
    assert want.abs().max() > 0.1
    assert (got[0][..., : want.shape[-1]] - want).abs().max() < 1e-6
