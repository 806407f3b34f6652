"""Megatron-LM flags that its users' own scripts carry: --make-vocab-size-divisible-by (the
vocabulary's padding, checked against Megatron-LM's vocab_size_with_padding), the fine-tuning
start --pretrained-checkpoint, --tensorboard-log-interval, the switches that hold already
(--use-flash-attn, --transformer-impl, --optimizer adam, --log-validation-ppl-to-tensorboard),
and the flags megart cannot honour, each refused by name with what to do instead."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import train_workers as tw
from megart import ConfigError
from megart.cli.train import main as train_main
from megart.launcher import launch
from megart.models.config import GPTConfig
from megart.training.checkpoint import FILE, iteration_dir, read_file
from megart.training.megatron_args import config_from_args
from megart.training.megatron_files import torch_load

VOCAB = 300  # the built-in corpus has 256 byte ids; 300 pads differently for each multiple


def megatron_padding(vocab: int, multiple: int, tp: int) -> int:
    """Megatron-LM's vocab_size_with_padding (megatron/core/tokenizers/utils/build_tokenizer.py),
    as written there: ceil(vocab / (multiple x tp)) x multiple x tp."""
    step = multiple * tp
    return int(math.ceil(vocab / step) * step)


@settings(max_examples=200, deadline=None)
@given(
    vocab=st.integers(1, 300_000),
    multiple=st.sampled_from([1, 2, 8, 64, 128, 256, 3, 100]),
    tp=st.sampled_from([1, 2, 4, 8, 3]),
)
def test_the_padded_vocabulary_is_megatrons(vocab, multiple, tp):
    cfg = GPTConfig(vocab_size=vocab, make_vocab_size_divisible_by=multiple)
    assert cfg.padded_vocab_size(tp) == megatron_padding(vocab, multiple, tp)


def test_gpt2s_vocabulary_pads_as_megatron_logs_it():
    # Megatron's "> padded vocab (size: 50257) with N dummy tokens" for GPT-2's tokenizer.
    pads = {(128, 1): 50304, (128, 2): 50432, (128, 8): 51200, (64, 1): 50304, (1, 8): 50264}
    for (multiple, tp), rows in pads.items():
        cfg = GPTConfig(vocab_size=50257, make_vocab_size_divisible_by=multiple)
        assert cfg.padded_vocab_size(tp) == rows
    with pytest.raises(ConfigError, match="make_vocab_size_divisible_by=0: give 1 or more"):
        GPTConfig(make_vocab_size_divisible_by=0)


@pytest.fixture(scope="module")
def default_padding(tmp_path_factory):
    """Four iterations at the default multiple (128), saved after the second: (directory,
    history)."""
    ckpt = tmp_path_factory.mktemp("padded128")
    kw = dict(train_iters=4, vocab_size=VOCAB, save=str(ckpt), save_interval=2)
    return ckpt, launch(tw.train_holding, 1, kw, timeout=300)[0]


def test_the_multiple_changes_the_padding_not_the_model(tmp_path, default_padding):
    _, straight = default_padding
    kw = dict(
        train_iters=4,
        vocab_size=VOCAB,
        tensor_model_parallel_size=2,
        make_vocab_size_divisible_by=1,
        save=str(tmp_path),
    )
    ranks = launch(tw.train_holding, 2, kw, timeout=300)
    # Each rank holds half of 300 rows (128 x 2 would pad to 512): padded rows never enter the
    # loss, so the curve and the weights are the one-process run's at the default multiple.
    for t in range(2):
        state = read_file(iteration_dir(tmp_path, 4) / f"mp_rank_0{t}" / FILE)
        assert state["model"][0]["wte.weight"].shape[0] == VOCAB // 2
    losses = [h["loss"] for h in ranks[0]["history"]]
    assert losses == pytest.approx([h["loss"] for h in straight["history"]], **tw.SAME_RUN)
    for name, w in straight["trained"]["weights"].items():
        assert ranks[0]["trained"]["weights"][name].allclose(w, rtol=1e-4, atol=1e-6), name


def test_a_checkpoint_resumes_under_another_multiple(default_padding):
    ckpt, straight = default_padding
    kw = dict(train_iters=4, vocab_size=VOCAB, load=str(ckpt), ckpt_step=2)
    for multiple in (1, 64):  # 300 rows, then 320, from the saved 384
        resumed = launch(tw.train_holding, 1, {**kw, "make_vocab_size_divisible_by": multiple},
                         timeout=300)  # fmt: skip
        tw.assert_resumed_on_curve(straight["history"], resumed, **tw.SAME_RUN)
        assert resumed[0]["loaded"]["padding"] == 0.0  # the padding rows stay zero


def test_megatrons_args_record_the_multiple_and_the_padding_it_gives(tmp_path):
    kw = dict(train_iters=1, vocab_size=VOCAB, make_vocab_size_divisible_by=64,
              save=str(tmp_path), ckpt_format="torch")  # fmt: skip
    launch(tw.train_holding, 1, kw, timeout=300)
    state = torch_load(iteration_dir(tmp_path, 1) / "mp_rank_00" / FILE)
    args = vars(state["args"])
    assert args["make_vocab_size_divisible_by"] == 64
    assert args["padded_vocab_size"] == megatron_padding(VOCAB, 64, 1) == 320
    assert state["model"]["embedding.word_embeddings.weight"].shape[0] == 320
    assert config_from_args(args).make_vocab_size_divisible_by == 64
    assert config_from_args({**args, "make_vocab_size_divisible_by": None}).padded_vocab_size(
        1
    ) == megatron_padding(VOCAB, 128, 1)  # older args without it: Megatron's default


def test_pretrained_checkpoint_starts_a_fine_tuning_run_where_load_holds_none(
    tmp_path, default_padding
):
    ckpt, straight = default_padding
    job = tmp_path / "job"  # a restartable job: --save and --load the same directory
    kw = dict(train_iters=2, vocab_size=VOCAB, ckpt_step=2, pretrained_checkpoint=str(ckpt),
              load=str(job), save=str(job))  # fmt: skip
    first = launch(tw.train_holding, 1, kw, timeout=300)[0]
    # As --finetune: the pretrained weights at iteration 2, from iteration 0, fresh moments.
    assert [h["iteration"] for h in first["history"]] == [1, 2]
    assert first["loaded"]["optimizer_states"] == 0
    saved = read_file(iteration_dir(ckpt, 2) / "mp_rank_00" / FILE)["model"][0]
    for name, w in first["loaded"]["weights"].items():
        assert w.equal(saved[name.removeprefix("chunk.")][: w.shape[0]]), name
    # Restarted, the job resumes what it saved, not the pretrained checkpoint.
    again = launch(tw.train_holding, 1, {**kw, "train_iters": 3, "ckpt_step": None},
                   timeout=300)[0]  # fmt: skip
    assert [h["iteration"] for h in again["history"]] == [3]
    for name, w in first["trained"]["weights"].items():
        assert again["loaded"]["weights"][name].equal(w), name
    empty = dict(train_iters=1, vocab_size=VOCAB, pretrained_checkpoint=str(tmp_path / "none"))
    with pytest.raises(Exception, match="--pretrained-checkpoint .*none holds no checkpoint"):
        launch(tw.train_holding, 1, empty, timeout=300)


def test_tensorboard_log_interval_spaces_the_training_scalars_not_the_evaluations(tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    kw = dict(train_iters=5, tensorboard_dir=str(tmp_path), tensorboard_log_interval=2,
              eval_iters=1, eval_interval=3)  # fmt: skip
    history = launch(tw.train_holding, 1, kw, timeout=300)[0]["history"]
    board = event_accumulator.EventAccumulator(str(tmp_path))
    board.Reload()
    losses = [(e.step, e.value) for e in board.Scalars("lm loss")]
    assert losses == [(i, pytest.approx(history[i - 1]["loss"], rel=1e-6)) for i in (2, 4)]
    # Evaluations at 3 and after the last, 5: written though neither is a multiple of 2.
    assert [e.step for e in board.Scalars("lm loss validation")] == [3, 5]
    assert [e.step for e in board.Scalars("lm loss validation ppl")] == [3, 5]


def flags_of(argv: list[str]):
    """The TrainConfig megart train builds from ``argv`` (it stops before training)."""
    from megart.cli.train import FlagParser, add_arguments, config_from_args

    parser = FlagParser(prog="megart train")
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_switches_that_hold_already_are_taken():
    config = flags_of(["--use-flash-attn", "--transformer-impl", "local", "--optimizer", "adam",
                       "--log-validation-ppl-to-tensorboard"])  # fmt: skip
    assert config.attention_backend == "flash"
    assert config.gpt_config().attention_backend == "flash"
    assert flags_of(["--transformer-impl", "local"]).gpt_config() == flags_of([]).gpt_config()
    with pytest.raises(ConfigError, match="--use-flash-attn with --attention-backend unfused"):
        flags_of(["--use-flash-attn", "--attention-backend", "unfused"])
    with pytest.raises(ConfigError, match="--tensorboard-log-interval 0: give 1 or more"):
        flags_of(["--tensorboard-log-interval", "0"])


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--non-persistent-save-interval", "5"], "needs --non-persistent-ckpt-type global"),
        (["--async-save"], "only torch_dist checkpoints are written in the background"),
        (["--wandb-project", "p"], "not to Weights & Biases"),
        (["--use-precision-aware-optimizer"], "fp32 moments"),
        (["--use-torch-fsdp2"], "use that"),
        (["--optimizer", "sgd"], "invalid choice: 'sgd'"),
        (["--cp-comm-type", "a2a+p2p", "--context-parallel-size", "2"], "no hierarchical"),
    ],
)
def test_flags_megart_cannot_honour_are_refused_by_name(argv, says, capsys):
    assert train_main(argv) != 0
    err = capsys.readouterr().err
    assert argv[0] in err and says in err
