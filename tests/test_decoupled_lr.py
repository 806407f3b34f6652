"""--decoupled-lr and --decoupled-min-lr against Megatron-Core 0.16.1: the same param groups
(its _get_param_groups: the word embedding and output layer in a group of their own, between
the default group and the one without weight decay, with their own max_lr and min_lr), the
same rates per group (its OptimizerParamScheduler), and runs where a pipeline stage has no
such parameter."""

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import decoupled_workers as dw
import train_workers as tw
from megart.errors import ConfigError
from megart.launcher import LaunchError, launch
from megart.training.megatron_optimizer import MEGATRON_GROUP_KEYS, megatron_group_keys

GPT2 = dict(vocab_size=256, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4)
LLAMA = dict(GPT2, normalization="rmsnorm", position_embedding="rotary", bias=False,
             untie_embeddings_and_output_weights=True)  # fmt: skip
TRAIN = {"gpt2": {}, "llama": dict(normalization="RMSNorm", position_embedding_type="rope",
                                   disable_bias_linear=True,
                                   untie_embeddings_and_output_weights=True)}  # fmt: skip


@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.parametrize("dmin", [None, 2e-5])
def test_groups_are_megatron_cores(model, dmin):
    kw = dict(GPT2 if model == "gpt2" else LLAMA)
    (theirs,) = launch(dw.megatron_core_groups, 1, kw, 3e-3, 3e-4, 5e-4, dmin, timeout=300)
    sizes = dict(GPT2)
    train = dict(
        TRAIN[model], **sizes, lr=3e-3, min_lr=3e-4, decoupled_lr=5e-4, decoupled_min_lr=dmin
    )
    (ours,) = launch(dw.megart_groups, 1, train, timeout=300)
    assert [g["max_lr"] for g in theirs] == [3e-3, 5e-4, 3e-3]
    assert [g["max_lr"] or 3e-3 for g in ours] == [g["max_lr"] for g in theirs]
    assert [g["min_lr"] or 3e-4 for g in ours] == [g["min_lr"] for g in theirs]
    assert [g["weight_decay"] > 0 for g in ours] == [g["wd_mult"] > 0 for g in theirs]
    want = ["embedding.word_embeddings.weight"] + ["output_layer.weight"] * (model == "llama")
    assert ours[1]["names"] == theirs[1]["names"] == want
    # What --ckpt-format torch files record of each group: Megatron-Core's keys.
    written = megatron_group_keys(3e-3, 3e-4, (5e-4, 3e-4 if dmin is None else dmin))
    assert written == [{k: g[k] for k in MEGATRON_GROUP_KEYS} for g in theirs]
    # The other groups hold the same parameters too (as many; the names differ by layer).
    assert [len(g["names"]) for g in ours] == [len(g["names"]) for g in theirs]


@settings(max_examples=30, deadline=None)
@given(
    warmup=st.integers(0, 10),
    style=st.sampled_from(["linear", "cosine", "inverse-square-root", "constant"]),
    dmin=st.sampled_from([None, 1e-5]),
    init=st.sampled_from([0.0, 1e-4]),
)
def test_each_groups_rate_is_megatron_cores(warmup, style, dmin, init):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    c = tw.tiny(train_iters=20, lr=3e-3, min_lr=3e-4, lr_warmup_iters=warmup,
                lr_decay_style=style, lr_warmup_init=init, decoupled_lr=5e-4,
                decoupled_min_lr=dmin)  # fmt: skip
    groups = [{}, {"max_lr": 5e-4, "min_lr": 3e-4 if dmin is None else dmin}]
    gbs = c.global_batch_size  # Megatron's scheduler counts samples
    scheduler = OptimizerParamScheduler(
        SimpleNamespace(param_groups=groups), init, c.lr, c.min_lr, warmup * gbs, 20 * gbs,
        style, 0.0, 0.0, 1, "constant",
    )  # fmt: skip
    for n in range(21):
        scheduler.num_steps = n * gbs
        want = [scheduler.get_lr(g) for g in groups]
        got = [c.learning_rate(n), c.learning_rate(n, 5e-4, groups[1]["min_lr"])]
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_stages_without_an_embedding_keep_the_group_and_every_rate_is_applied():
    """pp4 with the distributed optimizer: the middle stages' decoupled group is empty (every
    rank has the same groups, as Megatron-Core aligns them); the first and last stages step
    the embedding and its tied copy at the decoupled rate."""
    kw = dict(pipeline_model_parallel_size=4, num_layers=4, decoupled_lr=5e-4,
              decoupled_min_lr=1e-5, use_distributed_optimizer=True, lr_warmup_iters=0)  # fmt: skip
    ranks = launch(dw.megart_groups, 4, kw, timeout=300)
    c = tw.tiny(**kw)
    for stage, groups in enumerate(ranks):
        assert len(groups) == 3
        held = groups[1]["names"]
        assert held == (["embedding.word_embeddings.weight"] if stage in (0, 3) else [])
        assert groups[1]["lr"] == pytest.approx(c.learning_rate(1, 5e-4, 1e-5), rel=1e-12)
        assert groups[0]["lr"] == groups[2]["lr"] == pytest.approx(c.learning_rate(1), rel=1e-12)
        assert groups[1]["lr"] != groups[0]["lr"]


def test_decoupled_min_lr_alone_is_refused():
    with pytest.raises(ConfigError, match="--decoupled-min-lr is the floor .*give --decoupled-lr"):
        tw.tiny(decoupled_min_lr=1e-5).check(1)


@pytest.mark.parametrize("fmt", ["megart", "torch"])
def test_resuming_under_other_param_groups_names_decoupled_lr(tmp_path, fmt):
    """A checkpoint saved without --decoupled-lr resumed with it (its optimizer state has one
    group less than the run's) is refused naming the flag, in either checkpoint format."""
    ckpt = str(tmp_path / "ckpt")
    launch(tw.train_kw, 1, dict(train_iters=3, exit_interval=2, save=ckpt, ckpt_format=fmt),
           timeout=300)  # fmt: skip
    with pytest.raises(LaunchError, match="2 param groups and this run's optimizer 3 "
                       r"\(--decoupled-lr adds one"):  # fmt: skip
        launch(tw.train_kw, 1, dict(train_iters=3, load=ckpt, decoupled_lr=5e-4), timeout=300)
