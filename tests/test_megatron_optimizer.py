"""The optimizer state of ``--ckpt-format torch`` against Megatron-Core itself (megatron-core
0.16.1, CPU): Megatron-Core's GPTModel, its own param groups (``_get_param_groups``) and its
FP32Optimizer load what megart train wrote and take the next steps as megart does (the same
losses, the same weights after a step); and megart train --load resumes the checkpoint that
Megatron-Core's side then wrote from its own state dicts, on megart's uninterrupted loss
curve. Under --bf16 its Float16OptimizerWithFloat16Params loads megart's files and, with
--half-weights (Megatron's own mixed precision), steps as megart does. GPT-2-style and
Llama-style (RMSNorm, rope, SwiGLU with biases, GQA, untied) models, at tensor-parallel 1 and
2."""

import pytest
import torch

import megatron_bf16_workers as mbw
import megatron_optim_workers as mow
import train_workers as tw
from megart.errors import ConfigError
from megart.launcher import launch
from train_workers import SAME_RUN

# A vocabulary that is padded (to 384 rows at tp1, 512 at tp2).
LLAMA = dict(vocab_size=300, normalization="RMSNorm", position_embedding_type="rope",
             swiglu=True, ffn_hidden_size=64, untie_embeddings_and_output_weights=True,
             group_query_attention=True, num_query_groups=2)  # fmt: skip
CONFIGS = {
    "gpt2": {},
    "llama": LLAMA,
    # --decoupled-lr: the word embedding and the (untied) output layer in a third group between
    # the two, at their own rates (Megatron-Core's _get_param_groups, OptimizerParamScheduler).
    "llama-decoupled-lr": dict(LLAMA, decoupled_lr=5e-4, decoupled_min_lr=1e-5),
    # --weight-decay-incr-style: Megatron-Core's scheduler raises the decay each step (its
    # get_wd), megart's trainer as it (an effect of lr x wd x w ~ 1e-5 on the weights).
    "gpt2-rising-weight-decay": dict(
        weight_decay_incr_style="linear", start_weight_decay=0.0, end_weight_decay=0.5
    ),
    # WSD: Megatron-Core's iterations 2 and 3 are inside the exponential anneal of the last 4.
    "gpt2-wsd": dict(lr_decay_style="WSD", lr_wsd_decay_iters=4),
}
CASES = [(name, tp) for name in ("gpt2", "llama") for tp in (1, 2)] + [
    ("llama-decoupled-lr", 1),
    ("gpt2-rising-weight-decay", 1),
    ("gpt2-wsd", 1),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per case: megart's uninterrupted 5 iterations, saving each in Megatron's format (of
    which Megatron-Core's side reads those after iterations 1 and 2); Megatron-Core's
    iterations 2 and 3 from the first; megart resumed from the checkpoint Megatron-Core's side
    wrote after iteration 3.

    One launch gives the curve and the files, where a run without --save gave the curve and
    another, stopped after iteration 2, the files: that a --ckpt-format torch save leaves the
    run it is taken from as it was is what tests/test_megatron_train_ckpt.py's resumed curves
    check (against runs that save nothing), and a save that changed the live weights would put
    Megatron-Core's iterations 2 and 3, taken from the files, off this curve."""
    out = {}
    for name, tp in CASES:
        tmp = tmp_path_factory.mktemp(f"{name}-tp{tp}")
        kw = {**CONFIGS[name], "train_iters": 5, "tensor_model_parallel_size": tp}
        ours, theirs = str(tmp / "megart"), str(tmp / "megatron")
        straight = launch(tw.train_kw, tp, {**kw, "save": ours, "save_interval": 1,
                                       "ckpt_format": "torch"}, timeout=300)[0]  # fmt: skip
        megatron = launch(mow.resume_and_write, tp, kw, ours, theirs, timeout=300)
        resumed = launch(tw.train_kw, tp, {**kw, "load": theirs}, timeout=300)[0]
        out[name, tp] = dict(kw=kw, straight=straight, megatron=megatron, resumed=resumed,
                             dir=theirs)  # fmt: skip
    return out


@pytest.mark.parametrize("name,tp", CASES)
def test_megatron_core_resumes_megarts_optimizer_state(runs, name, tp):
    r = runs[name, tp]
    want = [h["loss"] for h in r["straight"][1:3]]
    decoupled = "decoupled_lr" in r["kw"]
    for rank in r["megatron"]:
        # Its groups, as Megatron-Core made them, each the size megart wrote.
        mults = [(1.0, 1.0)] * (1 + decoupled) + [(0.0, 1.0)]
        assert [(g["wd_mult"], g["lr_mult"]) for g in rank["groups"]] == mults
        assert all(g["size"] > 0 for g in rank["groups"])
        if decoupled:  # the word embedding and the output layer
            assert rank["groups"][1]["size"] == 2
        # Its scheduler gives the plain groups megart's rates, the decoupled group its own.
        for rates, h in zip(rank["rates"], r["straight"][1:3], strict=True):
            assert rates[0] == rates[-1] == pytest.approx(h["lr"], rel=1e-12)
            assert (rates[1] != rates[0]) == decoupled
        assert rank["weights_diff"] < 1e-6  # its step from megart's state is megart's step
        assert rank["losses"] == pytest.approx(want, **SAME_RUN)


@pytest.mark.parametrize("name,tp", CASES)
def test_megart_resumes_a_checkpoint_megatron_core_wrote(runs, name, tp):
    r = runs[name, tp]
    assert [h["iteration"] for h in r["resumed"]] == [4, 5]
    want = [h["loss"] for h in r["straight"][3:]]
    assert [h["loss"] for h in r["resumed"]] == pytest.approx(want, **SAME_RUN)


def test_a_megatron_written_checkpoint_reshards_on_load(runs):
    """Megatron-Core's tp2 checkpoint resumed by one process: read as megart's files, the
    resharding path takes it, Adam's moments included."""
    r = runs["llama", 2]
    kw = {**r["kw"], "tensor_model_parallel_size": 1, "load": r["dir"]}
    resumed = launch(tw.train_kw, 1, kw, timeout=300)[0]
    want = [h["loss"] for h in r["straight"][3:]]
    assert [h["loss"] for h in resumed] == pytest.approx(want, **SAME_RUN)


@pytest.mark.parametrize(
    "change,flag",
    [
        (dict(lr=2e-3), "--lr"),
        (dict(min_lr=0.0), "--min-lr"),
        (dict(train_iters=6), "--lr-decay-iters"),
        (dict(lr_decay_style="cosine"), "--lr-decay-style"),
        (dict(lr_warmup_iters=2), "--lr-warmup-iters"),
        (dict(weight_decay=0.1), "--weight-decay"),
    ],
)
def test_megatrons_scheduler_state_must_match_the_flags(runs, change, flag):
    """As Megatron's OptimizerParamScheduler.load_state_dict: the saved values must be the
    run's; a difference is refused naming the flag."""
    import train_workers as tw
    from megart.training.megatron_scheduler import check_scheduler

    r = runs["gpt2", 1]
    saved = torch.load(f"{r['dir']}/iter_0000003/mp_rank_00/{mow.FILE}", weights_only=False)
    saved = saved["opt_param_scheduler"]
    check_scheduler(saved, tw.tiny(**r["kw"]), r["dir"])  # the flags that wrote it
    with pytest.raises(ConfigError, match=flag):
        check_scheduler(saved, tw.tiny(**{**r["kw"], **change}), r["dir"])
    # Megatron's --override-opt_param-scheduler: the flags' schedule is taken instead.
    overriding = {**r["kw"], **change, "override_opt_param_scheduler": True}
    check_scheduler(saved, tw.tiny(**overriding), r["dir"])


def test_override_opt_param_scheduler_resumes_on_the_flags_schedule(runs):
    """A longer run resumed from Megatron-Core's checkpoint: refused as it was written (the
    decay follows --train-iters), and with the override its learning rates are those of a run
    given the new flags from the start, at the saved iteration on."""
    import train_workers as tw

    r = runs["gpt2", 1]
    longer = {**r["kw"], "train_iters": 7}
    with pytest.raises(Exception, match="--override-opt_param-scheduler"):
        launch(tw.train_kw, 1, {**longer, "load": r["dir"]}, timeout=300)
    override = {**longer, "load": r["dir"], "override_opt_param_scheduler": True}
    resumed = launch(tw.train_kw, 1, override, timeout=300)[0]
    straight = launch(tw.train_kw, 1, longer, timeout=300)[0]
    assert [h["iteration"] for h in resumed] == [4, 5, 6, 7]
    assert [h["lr"] for h in resumed] == pytest.approx([h["lr"] for h in straight[3:]])
    # Not the schedule the checkpoint was saved with (decaying to --min-lr by iteration 5).
    assert [h["lr"] for h in resumed[:2]] != pytest.approx([h["lr"] for h in r["straight"][3:]])


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_cores_bf16_optimizer_loads_megarts_bf16_files(tmp_path, tp):
    """--bf16: Megatron-Core's Float16OptimizerWithFloat16Params (over its own param groups of
    its bf16 GPTModel, which loads the file strictly) takes the optimizer state: each fp32
    master is its own parameter's (it rounds to the model's bf16 tensor, and holds more than
    it), and every Adam state has its parameter's shape."""
    kw = {**CONFIGS["llama"], "bf16": True, "train_iters": 2, "tensor_model_parallel_size": tp}
    launch(tw.train_kw, tp, {**kw, "save": str(tmp_path), "ckpt_format": "torch"}, timeout=300)
    for r in launch(mbw.load_bf16, tp, kw, str(tmp_path), timeout=300):
        assert r["masters"] == r["params"] > 0
        assert r["masters_match"] and r["masters_differ"] and r["shapes_match"]
        assert r["steps"] == {2.0}


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_cores_bf16_optimizer_steps_as_megart_half_weights(tmp_path, tp):
    """--bf16 --half-weights, Megatron's own mixed precision: from megart's checkpoint after
    iteration 1, Megatron-Core's Float16OptimizerWithFloat16Params, given the gradients
    megart's next step read (as ``main_grad``) and its learning rate, steps its fp32 main
    weights to megart's (float rounding apart: torch's AdamW against megart's) and rounds
    them into the same bf16 weights."""
    kw = {**CONFIGS["llama"], "bf16": True, "half_weights": True, "train_iters": 2,
          "lr_warmup_iters": 0,  # iteration 1 moves the weights: its file is not the start
          "tensor_model_parallel_size": tp, "ckpt_format": "torch"}  # fmt: skip
    launch(tw.train_kw, tp, {**kw, "save": str(tmp_path), "exit_interval": 1}, timeout=300)
    ours = launch(mbw.megart_half_weights_step, tp, kw, str(tmp_path), timeout=300)
    torch.save(ours, tmp_path / "megart_step.pt")
    theirs = launch(
        mbw.megatron_bf16_step,
        tp,
        kw,
        str(tmp_path),
        str(tmp_path / "megart_step.pt"),
        timeout=300,
    )
    for r in theirs:
        assert r["params"] > 0 and r["moved"] > 1e-4  # the step moved the main weights
        assert r["main_diff"] < 1e-6 and r["rounded"]
        assert r["weights_differing"] == 0


def test_megatron_core_loads_each_pipeline_stages_optimizer_state(tmp_path):
    """pp2 (GPT-2-style, tied: the last stage's output layer is the embedding's copy): each
    stage's Megatron-Core GPTModel and FP32Optimizer load its file, and the Adam moments they
    hold for each parameter are those the one-stage run's file gives Megatron-Core for the same
    parameter (the same training, 1e-5); the pp2 checkpoint the stages write from their own
    state dicts resumes under megart's pp2 on the uninterrupted curve."""
    kw = dict(train_iters=4, ckpt_format="torch")
    one, two, theirs = (str(tmp_path / d) for d in ("pp1", "pp2", "megatron"))
    straight = launch(tw.train_kw, 1, kw, timeout=300, env=tw.ONE_THREAD)[0]
    launch(tw.train_kw, 1, {**kw, "save": one, "exit_interval": 2}, timeout=300, env=tw.ONE_THREAD)
    pp2 = {**kw, "pipeline_model_parallel_size": 2}
    launch(tw.train_kw, 2, {**pp2, "save": two, "exit_interval": 2}, timeout=300)
    (want,) = launch(mow.pipeline_states, 1, kw, one, timeout=300)
    stages = launch(mow.pipeline_states, 2, kw, two, theirs, timeout=300)
    assert "embedding.word_embeddings.weight" in stages[1]  # the tied copy's moments
    got = {n for stage in stages for n in stage}
    assert got == set(want)
    for stage in stages:
        for n, moment in stage.items():
            torch.testing.assert_close(moment, want[n], rtol=1e-5, atol=1e-9)
    # What the stages then wrote from their own state dicts resumes on the one-stage curve,
    # under pp2 and resharded to one stage.
    want_losses = [h["loss"] for h in straight[2:]]
    for n, flags in ((2, pp2), (1, kw)):
        resumed = launch(tw.train_kw, n, {**flags, "load": theirs}, timeout=300)[0]
        assert [h["iteration"] for h in resumed] == [3, 4]
        assert [h["loss"] for h in resumed] == pytest.approx(want_losses, **SAME_RUN)


def test_load_refuses_a_changed_scheduler_unless_the_optimizer_is_left_out(runs):
    """megart train's load of the checkpoint Megatron-Core's side wrote: another --lr is
    refused naming it, before anything is loaded; with --no-load-optim (Megatron reads no
    scheduler then either) the weights load and the iteration and samples are the file's."""
    from types import SimpleNamespace

    import train_workers as tw
    from megart.models import GPTChunk
    from megart.training import checkpoint

    r = runs["gpt2", 1]
    grid = SimpleNamespace(tp_rank=0, pp_rank=0)
    config = tw.tiny(**{**r["kw"], "lr": 2e-3, "load": r["dir"]})
    chunks = [GPTChunk(config.gpt_config(), range(config.num_layers), True, True)]
    with pytest.raises(ConfigError, match="max_lr 0.001 .* 0.002; set --lr"):
        checkpoint.load(r["dir"], config, grid, chunks, None, None)
    config.no_load_optim = config.no_load_rng = True
    assert checkpoint.load(r["dir"], config, grid, chunks, None, None) == (3, 24)


def test_a_vocabulary_that_pads_otherwise_is_refused(runs):
    """Megatron-Core's side recorded the padded vocabulary alone (vocab_size None, as
    Megatron-LM's GPT-2 tokenizer runs do): --vocab-size 300 pads to its 384 rows and loads
    (the resumed curves above); 400 pads to 512 and is refused, naming both."""
    from types import SimpleNamespace

    import train_workers as tw
    from megart.models import GPTChunk
    from megart.training import checkpoint

    r = runs["llama", 1]
    config = tw.tiny(**{**r["kw"], "vocab_size": 400, "load": r["dir"]})
    chunks = [GPTChunk(config.gpt_config(), range(config.num_layers), True, True)]
    grid = SimpleNamespace(tp_rank=0, pp_rank=0)
    with pytest.raises(ConfigError, match="padded to 384 rows .*--vocab-size 400 pads to 512"):
        checkpoint.load(r["dir"], config, grid, chunks, None, None)


def test_convert_to_hf_merges_megatron_cores_files_in_memory(runs, tmp_path):
    """convert-checkpoint --from megatron --to hf of Megatron-Core's own tp2 legacy files
    writes, without a release checkpoint on the way, the files that going through one
    (--to megart, then export-hf) writes."""
    from megart.cli.convert import convert
    from megart.training.export_hf import export_checkpoint
    from megart.training.megatron_checkpoint import megatron_to_megart

    r = runs["llama", 2]
    convert("megatron", "hf", r["dir"], str(tmp_path / "direct"))
    megatron_to_megart(r["dir"], tmp_path / "release")
    export_checkpoint(tmp_path / "release", tmp_path / "through")
    files = sorted(p.name for p in (tmp_path / "direct").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "through").iterdir())
    assert "model.safetensors" in files
    for name in files:
        assert (tmp_path / "direct" / name).read_bytes() == (
            tmp_path / "through" / name
        ).read_bytes(), name
