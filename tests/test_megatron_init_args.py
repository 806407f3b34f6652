"""The initialisation flags (--init-method-std, --init-method-xavier-uniform) in Megatron-LM's
args: written and read back, so that a convert-checkpoint round trip keeps them (it had reset
the std to 0.02)."""

import dataclasses

import pytest

import train_workers as tw
from megart.cli.main import main
from megart.launcher import launch
from megart.training.megatron_args import config_from_args, megatron_args

pytest.importorskip("megatron.core")


def test_megatron_lms_args_carry_the_init_flags_both_ways():
    from megatron.core.transformer import TransformerConfig

    # Megatron-LM's argparse makes --init-method-std from TransformerConfig's field (its
    # ArgumentGroupFactory): the args hold it under that name.
    assert "init_method_std" in {f.name for f in dataclasses.fields(TransformerConfig)}
    cfg = tw.tiny(init_method_std=0.006).gpt_config()
    a = vars(megatron_args(cfg, 1))
    assert (a["init_method_std"], a["init_method_xavier_uniform"]) == (0.006, False)
    assert config_from_args(a).init_std == 0.006
    xavier = dataclasses.replace(cfg, init_method_xavier_uniform=True)
    assert config_from_args(vars(megatron_args(xavier, 1))).init_method_xavier_uniform
    older = {k: v for k, v in a.items() if not k.startswith("init_method")}
    assert config_from_args(older).init_std == 0.02  # Megatron-LM's default


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_convert_round_trip_keeps_the_init_std(tmp_path, fmt):
    from megart.training.checkpoint import iteration_dir, latest_iteration, model_config
    from megart.training.shards import read_shards

    ours, out, back = (str(tmp_path / n) for n in ("megart", "megatron", "back"))
    launch(tw.train_kw, 1, dict(init_method_std=0.006, save=ours, train_iters=1), timeout=300)
    assert main(["convert-checkpoint", "--from", "megart", "--to", "megatron", "--ckpt-format",
                 fmt, "--load", ours, "--save", out]) == 0  # fmt: skip
    assert main(["convert-checkpoint", "--from", "megatron", "--to", "megart", "--load", out,
                 "--save", back]) == 0  # fmt: skip
    root = iteration_dir(back, latest_iteration(back))
    assert model_config(read_shards(root)[0, 0]).init_std == 0.006
