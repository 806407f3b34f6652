"""megart train's YaRN flags (Megatron-LM's --position-embedding-type yarn,
--rotary-scaling-factor, --yarn-original-max-position-embeddings, --yarn-beta-fast,
--yarn-beta-slow, --mscale, --mscale-all-dim, --[no-]yarn-correction-range-round-to-int): the
model they give, every layout (tensor, sequence, pipeline and context parallelism, whose ranks
turn their tokens' global positions) on the one-process curve, the settings recorded in
megart's checkpoints and Megatron's args (and taken back by --use-checkpoint-args), and
refused by name where they cannot apply."""

import argparse
import dataclasses

import pytest

import megatron_core_ckpt_workers as mckw
import megatron_workers as mw
import train_workers as tw
from megart.cli.train import add_arguments, config_from_args
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models.yarn import YarnConfig
from megart.training import checkpoint
from megart.training.megatron_args import config_from_args as config_from_megatron
from megart.training.megatron_args import megatron_args

YARN_FIELDS = [f.name for f in dataclasses.fields(YarnConfig)]

# Heads of 8 (4 pairs) over 16 positions, extended 4 times from an original context of 8: the
# correction range blends pairs 0 to 2 (turning 4 times to once over 8 positions). Weights
# drawn ten times wider than the default, so that the attention logits, and so the rope and
# its concentration factor, move the loss (measured: plain rope's curve differs by 1.3e-2
# relative, YaRN's without the factor by 7.8e-3; at the default 0.02, by 1.4e-6).
YARN = dict(position_embedding_type="yarn", normalization="RMSNorm", swiglu=True,
            disable_bias_linear=True, rotary_scaling_factor=4.0,
            yarn_original_max_position_embeddings=8, yarn_beta_fast=4.0, mscale=1.5,
            init_method_std=0.2, train_iters=3)  # fmt: skip
LAYOUTS = {
    "tp2-sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2": dict(pipeline_model_parallel_size=2),
    "cp2-p2p": dict(context_parallel_size=2),
    "cp2-a2a": dict(context_parallel_size=2, cp_comm_type="a2a"),
    "cp2-all-gather-tp2": dict(
        context_parallel_size=2, cp_comm_type="all_gather", tensor_model_parallel_size=2
    ),
}
FLAGS = ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
         "--yarn-original-max-position-embeddings", "8", "--yarn-beta-fast", "4",
         "--mscale", "1.5", "--no-yarn-correction-range-round-to-int"]  # fmt: skip


def flags_config(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_the_flags_give_the_model_megatrons_defaults_for_what_is_left_out():
    cfg = flags_config(FLAGS).gpt_config()
    assert (cfg.position_embedding, cfg.rope_type) == ("rotary", "yarn")
    assert (cfg.yarn_rotary_scaling_factor, cfg.yarn_original_max_position_embeddings) == (4, 8)
    assert (cfg.yarn_beta_fast, cfg.yarn_beta_slow) == (4.0, 1.0)  # beta_slow: YaRN's 1
    assert (cfg.yarn_mscale, cfg.yarn_mscale_all_dim) == (1.5, 0.0)
    assert cfg.yarn_correction_range_round_to_int is False
    plain = flags_config(["--position-embedding-type", "yarn"]).gpt_config()
    assert plain.yarn_original_max_position_embeddings == 4096 and plain.yarn_beta_fast == 32
    assert plain.yarn_correction_range_round_to_int is True
    # Megatron-LM's explicit switch for the default is taken too.
    on = flags_config(["--position-embedding-type", "yarn", "--yarn-correction-range-round-to-int"])
    assert on.gpt_config() == plain
    assert flags_config(["--position-embedding-type", "rope"]).gpt_config().rope_type == "rope"


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--rotary-scaling-factor", "4"], "--rotary-scaling-factor 4.0 sets YaRN's"),
        (
            ["--position-embedding-type", "rope", "--yarn-beta-fast", "8", "--mscale-all-dim", "1"],
            "--yarn-beta-fast 8.0 and --mscale-all-dim 1.0 set YaRN's rope scaling: add "
            "--position-embedding-type yarn",
        ),
        (["--no-yarn-correction-range-round-to-int"], "--no-yarn-correction-range-round-to-int"),
        (
            ["--position-embedding-type", "yarn", "--use-rope-scaling"],
            "yarn with --use-rope-scaling: Megatron-Core's YaRN ignores",
        ),
        (
            ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "0.5"],
            "--rotary-scaling-factor 0.5 .*at least 1",
        ),
    ],
)
def test_what_cannot_apply_is_refused_naming_the_flags(argv, says):
    with pytest.raises(ConfigError, match=says):
        flags_config(argv).gpt_config()


def test_the_cli_refuses_settings_without_yarn_before_training():
    status, out = mw.run_cli(["--mscale", "2", "--train-iters", "1"])
    assert status == 2 and "--position-embedding-type yarn" in out and "iteration" not in out


@pytest.fixture(scope="module")
def one_process():
    return launch(tw.train_kw, 1, YARN, timeout=300)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_follows_the_one_process_curve(one_process, layout):
    nproc = 4 if "tp2" in layout and "cp2" in layout else 2
    for rank in launch(tw.train_kw, nproc, dict(YARN, **LAYOUTS[layout]), timeout=300):
        assert [h["loss"] for h in rank] == pytest.approx(
            [h["loss"] for h in one_process], **tw.SAME_RUN
        )


def test_the_curve_is_yarns_not_ropes(one_process):
    """What the bound above tells apart: plain rope's curve, and YaRN's without its
    concentration factor (--mscale 0 --mscale-all-dim 0: a factor of 1)."""
    plain = dict(YARN, position_embedding_type="rope")
    for flag in ("rotary_scaling_factor", "yarn_original_max_position_embeddings",
                 "yarn_beta_fast", "mscale"):  # fmt: skip
        plain.pop(flag)
    flat = dict(YARN, mscale=0.0)
    want = [h["loss"] for h in one_process]
    for other in (plain, flat):
        got = [h["loss"] for h in launch(tw.train_kw, 1, other, timeout=300)[0]]
        assert max(abs(a - b) / b for a, b in zip(got, want, strict=True)) > 1e-3


def test_checkpoints_record_yarn_and_refuse_other_settings(tmp_path):
    """megart train --save records the settings; --load under other settings (plain rope,
    another beta) is refused naming the flags; Megatron's args (its checkpoints') carry them
    and --use-checkpoint-args takes them back."""
    ckpt = tmp_path / "ckpt"
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--normalization", "RMSNorm", "--swiglu", "--eval-iters", "0", *FLAGS,
            "--train-iters", "2", "--save", str(ckpt)]  # fmt: skip
    status, out = launch(mw.run_cli, 1, argv, timeout=300)[0]
    assert status == 0 and "iteration     2/2 |" in out and "loss nan" not in out, out
    state = checkpoint.read_file(ckpt / "iter_0000002" / "mp_rank_00" / checkpoint.FILE)
    saved = checkpoint.model_config(state)
    assert saved == flags_config(argv).gpt_config()
    base = dict(num_layers=2, global_batch_size=4, normalization="RMSNorm", swiglu=True)
    yarn_now = dict(base, position_embedding_type="yarn", rotary_scaling_factor=4.0,
                    yarn_original_max_position_embeddings=8, yarn_beta_fast=4.0, mscale=1.5,
                    yarn_correction_range_round_to_int=False, load=str(ckpt))  # fmt: skip
    was = (
        r"--position-embedding-type yarn \(now --position-embedding-type rope\), --rotary-base "
        r"10000 \(halves\) --rotary-scaling-factor 4 --yarn-original-max-position-embeddings 8 "
        r"--yarn-beta-fast 4 --yarn-beta-slow 1 --mscale 1.5 --mscale-all-dim 0 "
        r"--no-yarn-correction-range-round-to-int \(now --rotary-base 10000 \(halves\)\)"
    )
    for kw, match in (
        (dict(base, position_embedding_type="rope", load=str(ckpt)), was),
        (dict(yarn_now, yarn_beta_fast=8.0), r"--yarn-beta-fast 4 .*\(now .*--yarn-beta-fast 8 "),
    ):
        config = tw.tiny(**kw)
        with pytest.raises(ConfigError, match=match):
            checkpoint._check_model(ckpt, state, config, config.gpt_config())
    same = tw.tiny(**yarn_now)
    checkpoint._check_model(ckpt, state, same, same.gpt_config())
    # A checkpoint saved before the fields existed is plain rope, which it was.
    old = {**state, "model_config": {k: v for k, v in state["model_config"].items()
                                     if "yarn" not in k and k != "rope_type"}}  # fmt: skip
    assert checkpoint.model_config(old).rope_type == "rope"
    # --use-checkpoint-args takes the settings from the checkpoint.
    taken = flags_config(["--load", str(ckpt), "--use-checkpoint-args"])
    assert taken.gpt_config() == saved
    assert (taken.position_embedding_type, taken.mscale, taken.yarn_beta_fast) == ("yarn", 1.5, 4)


def test_megatron_args_record_yarn_as_megatron_lm_does():
    cfg = flags_config(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
                        "4", *FLAGS]).gpt_config()  # fmt: skip
    args = vars(megatron_args(cfg, 5))
    assert args["position_embedding_type"] == "yarn"
    assert (args["rotary_scaling_factor"], args["mscale"], args["mscale_all_dim"]) == (4, 1.5, 0)
    assert args["yarn_original_max_position_embeddings"] == 8 and args["yarn_beta_slow"] == 1
    assert args["yarn_correction_range_round_to_int"] is False
    read = config_from_megatron(args)
    assert {f: getattr(read, f) for f in YARN_FIELDS} == {f: getattr(cfg, f) for f in YARN_FIELDS}
    # Megatron-LM's unset settings (None) are its YaRN's defaults; its YaRN ignores Llama 3's
    # scaling, interpolation and --rotary-percent, and without yarn its settings mean nothing.
    unset = {**args, "yarn_original_max_position_embeddings": None, "yarn_beta_fast": None,
             "yarn_beta_slow": None, "yarn_correction_range_round_to_int": None,
             "use_rope_scaling": True, "rotary_seq_len_interpolation_factor": 2,
             "rotary_percent": 0.5}  # fmt: skip
    assert read.position_embedding == "rotary"
    read = config_from_megatron(unset)
    assert (read.yarn_original_max_position_embeddings, read.yarn_beta_fast) == (4096, 32.0)
    assert read.yarn_correction_range_round_to_int and not read.rope_scaling
    assert read.rotary_seq_len_interpolation_factor is None and read.rotary_percent == 1
    assert config_from_megatron({**args, "position_embedding_type": "rope"}).rope_type == "rope"
    plain = vars(megatron_args(flags_config(["--position-embedding-type", "rope"]).gpt_config(), 1))
    assert plain["position_embedding_type"] == "rope" and plain["rotary_scaling_factor"] == 1.0
    assert plain["yarn_beta_fast"] is None and plain["yarn_correction_range_round_to_int"] is None


def test_a_yarn_checkpoint_converts_to_megatrons_legacy_format_and_back(tmp_path):
    """Converted to Megatron-LM's legacy checkpoint, a YaRN run's weights load strictly into
    Megatron-Core's GPTModel built from the args megart wrote (position_embedding_type yarn and
    its settings), which computes megart's logits; converted back, the weights and the model
    config are the original ones."""
    ckpt = tmp_path / "ckpt"
    kw = dict(YARN, num_layers=2, train_iters=1, save=str(ckpt), tensor_model_parallel_size=2)
    del kw["init_method_std"]  # Megatron-LM's args do not record it (a default config back)
    launch(tw.train_kw, 2, kw, timeout=300)
    r = launch(mckw.legacy_checkpoint_roundtrip, 1, str(ckpt), str(tmp_path), timeout=300)[0]
    assert r["logits"] < 1e-5 and r["iteration"] == 1
    assert r["same_weights"] and r["same_config"]
