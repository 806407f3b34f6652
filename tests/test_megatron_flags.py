"""Megatron-LM's flags under megart train: its GPT example runs unchanged (sizes shrunk), the
tokenizers come from the tokenizers and transformers libraries, samples-based schedules follow
Megatron's formulas, rope rotates halves (or adjacent pairs with --rotary-interleaved, as old
checkpoints do), what megart cannot do is refused by name, and the overlap flags are real."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megatron_workers as mw
import train_workers as tw
from megart.cli.train import add_arguments, config_from_args
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.training import checkpoint
from megart.training.indexed import IndexedTokens, write_indexed
from megatron_workers import megatron_rate


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """A GPT-2-format vocabulary and merges file (byte-level BPE trained by the tokenizers
    library: 256 byte symbols and some merges) and a corpus tokenized with it."""
    from tokenizers import ByteLevelBPETokenizer

    where = tmp_path_factory.mktemp("gpt2")
    text = "the quick brown fox jumps over the lazy dog; pack my box with five dozen jugs. "
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([text] * 50, vocab_size=300, show_progress=False)
    bpe.save_model(str(where), "gpt2")
    ids = np.array(bpe.encode(text * 20).ids, dtype=np.uint16)
    ids = np.tile(ids, -(-40_000 // len(ids)))  # --split 949,50,1 leaves the test 40 tokens
    write_indexed(where / "corpus_text_document", [ids[: len(ids) // 2], ids[len(ids) // 2 :]],
                  np.uint16)  # fmt: skip
    return where, bpe.get_vocab_size()


def parse(*argv: str):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(list(argv)))


def test_megatrons_switches_that_turn_a_fusion_off_are_accepted_and_change_nothing():
    """A kernel choice never changes the math: each of Megatron's --no-*-fusion switches gives
    the default config, except --no-bias-gelu-fusion, megart's own switch (on by default, as
    Megatron's), last flag winning."""
    from megart.training.megatron_flags import FUSIONS_OFF

    default = parse()
    assert parse(*FUSIONS_OFF) == dataclasses.replace(default, bias_gelu_fusion=False)
    assert default.gpt_config().bias_gelu_fusion
    assert not parse(*FUSIONS_OFF).gpt_config().bias_gelu_fusion
    assert not parse("--bias-gelu-fusion", "--no-bias-gelu-fusion").bias_gelu_fusion
    assert parse("--no-bias-gelu-fusion", "--bias-gelu-fusion").bias_gelu_fusion
    assert parse("--swiglu", "--no-bias-swiglu-fusion", "--no-bias-gelu-fusion").swiglu


def test_the_gpt3_175b_example_runs_unchanged_with_its_sizes_shrunk(gpt2_files, tmp_path):
    """Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh (as it was up to April 2026,
    before --step-batch-size-schedule replaced its ramp-up line), flag for flag, with sizes,
    parallel sizes, iterations and intervals shrunk; its ramp-up line as it is: the global
    batch starts at 16 and grows by 16 every 5859375 / ((32 - 16) / 16) samples (Megatron's
    own argument check refuses the ramp with --train-iters; megart runs it)."""
    where, vocab = gpt2_files
    ckpt, board = tmp_path / "ckpt", tmp_path / "tb"
    # fmt: off
    argv = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--attention-backend", "auto",
        "--micro-batch-size", "1", "--global-batch-size", "32",
        "--rampup-batch-size", "16", "16", "5859375", "--train-iters", "2",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
        "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
        "--lr-decay-iters", "2",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        "--data-path", str(where / "corpus_text_document"),
        "--vocab-file", str(where / "gpt2-vocab.json"),
        "--merge-file", str(where / "gpt2-merges.txt"), "--split", "949,50,1",
        "--log-interval", "1", "--save-interval", "1", "--eval-interval", "1",
        "--save", str(ckpt), "--load", str(ckpt), "--eval-iters", "1",
        "--tensorboard-dir", str(board),
    ]
    # fmt: on
    status, out = launch(mw.run_cli, 1, argv, timeout=300)[0]
    assert status == 0, out
    assert "iteration     2/2 | consumed samples 32 | global batch size 16 |" in out
    assert "validation loss at iteration 2" in out
    assert checkpoint.latest_iteration(ckpt) == 2
    state = checkpoint.read_file(ckpt / "iter_0000002" / "mp_rank_00" / checkpoint.FILE)
    assert checkpoint.model_config(state).vocab_size == vocab  # the tokenizer's
    assert state["consumed_train_samples"] == 32  # 16 and 16: the ramp's first batches
    assert any(board.iterdir())


def test_tokenizers_give_the_vocabulary(gpt2_files, tmp_path):
    from transformers import PreTrainedTokenizerFast

    where, vocab = gpt2_files
    files = dict(
        vocab_file=str(where / "gpt2-vocab.json"), merge_file=str(where / "gpt2-merges.txt")
    )
    assert tw.tiny(**files).vocab_size == vocab  # GPT2BPETokenizer implied by the files
    assert tw.tiny(tokenizer_type="GPT2BPETokenizer", **files).vocab_size == vocab
    fast = PreTrainedTokenizerFast(tokenizer_file=None, tokenizer_object=_bpe(where)._tokenizer)
    fast.add_special_tokens({"eos_token": "<|endoftext|>"})
    fast.save_pretrained(tmp_path / "hf")
    hf = tw.tiny(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "hf"))
    assert hf.vocab_size == len(fast) == vocab + 1
    assert tw.tiny(tokenizer_type="NullTokenizer", vocab_size=100).vocab_size == 101
    with pytest.raises(ConfigError, match="needs --vocab-file"):
        tw.tiny(tokenizer_type="GPT2BPETokenizer")
    with pytest.raises(ConfigError, match="needs --tokenizer-model"):
        tw.tiny(tokenizer_type="HuggingFaceTokenizer")


def test_a_copy_of_a_config_keeps_its_resolved_vocabulary(gpt2_files):
    """dataclasses.replace runs TrainConfig's resolution again on the resolved value:
    NullTokenizer's end-of-document id must not be added twice (it was: 101, 102, 103), and a
    --vocab-size given to the copy is the flag again."""
    null = tw.tiny(tokenizer_type="NullTokenizer", vocab_size=100)
    again = dataclasses.replace(dataclasses.replace(null, lr=1e-3))
    assert (null.vocab_size, again.vocab_size) == (101, 101)
    assert again.gpt_config().vocab_size == null.gpt_config().vocab_size
    assert dataclasses.replace(null, vocab_size=200).vocab_size == 201
    assert type(null.gpt_config().vocab_size) is int  # what checkpoints hold
    where, vocab = gpt2_files
    files = dict(
        vocab_file=str(where / "gpt2-vocab.json"), merge_file=str(where / "gpt2-merges.txt")
    )
    bpe = tw.tiny(tokenizer_type="GPT2BPETokenizer", **files)
    assert dataclasses.replace(bpe).vocab_size == vocab
    # The GPT-2 vocabulary given to NullTokenizer as its flag: its id is added to it.
    assert dataclasses.replace(bpe, tokenizer_type="NullTokenizer").vocab_size == vocab + 1


def _bpe(where):
    from tokenizers import ByteLevelBPETokenizer

    return ByteLevelBPETokenizer(str(where / "gpt2-vocab.json"), str(where / "gpt2-merges.txt"))


@settings(max_examples=50, deadline=None)
@given(
    gbs=st.integers(1, 64),
    iters=st.integers(2, 200),
    warmup=st.integers(0, 40),
    style=st.sampled_from(["linear", "cosine", "inverse-square-root", "constant"]),
)
def test_samples_based_schedules_follow_megatrons_formulas(gbs, iters, warmup, style):
    """Megatron counts the schedule in samples (gbs per iteration): the rate at n iterations
    done is its scheduler's at n gbs samples; iterations are train_samples // gbs."""
    samples = iters * gbs + gbs // 2  # a partial last batch is not trained
    decay, warm = samples - gbs, min(warmup * gbs // 3, samples - 2 * gbs)
    c = tw.tiny(global_batch_size=gbs, micro_batch_size=1, train_samples=samples,
                lr_decay_samples=decay, lr_warmup_samples=warm, lr_decay_style=style,
                lr_warmup_iters=0)  # fmt: skip
    c.check(1)
    assert c.train_iters == iters
    for n in range(iters + 1):  # Megatron-Core's scheduler after n iterations of gbs samples
        want = megatron_rate(n * gbs, c.lr, c.min_lr, warm, decay, style)
        assert c.learning_rate(n) == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_iterations_and_samples_do_not_mix():
    with pytest.raises(ConfigError, match="--train-iters and --train-samples exclude"):
        parse("--train-iters", "5", "--train-samples", "80")
    with pytest.raises(ConfigError, match="--lr-decay-iters with --train-samples"):
        tw.tiny(train_samples=80, lr_decay_iters=4, lr_warmup_iters=0).check(1)
    with pytest.raises(ConfigError, match="--lr-decay-samples with --train-iters"):
        tw.tiny(lr_decay_samples=80).check(1)


@pytest.mark.parametrize(
    "selective", [["--recompute-granularity", "selective"], ["--recompute-activations"]]
)
def test_recompute_spans_with_selective_recomputation_are_refused_as_megatron_does(selective):
    """Megatron-LM asserts that selective recomputation has no --recompute-method, and
    Megatron-Core's TransformerConfig no --recompute-num-layers; megart's config has defaults
    for both, so the command line is what tells they were given."""
    with pytest.raises(ConfigError, match="--recompute-method block with selective"):
        parse(*selective, "--recompute-method", "block")
    with pytest.raises(ConfigError, match="--recompute-num-layers 2 with selective"):
        parse(*selective, "--recompute-num-layers", "2")
    assert parse(*selective).gpt_config().recompute_granularity == "selective"
    full = parse("--recompute-granularity", "full", "--recompute-method", "block")
    assert full.gpt_config().recompute_method == "block"


@pytest.mark.parametrize(
    "flags, match",
    [
        (dict(context_parallel_size=2, seq_length=18), "18 is not divisible by 2 x --context-"),
        (dict(expert_model_parallel_size=4), "--expert-model-parallel-size 4 needs --num-experts"),
        (dict(max_position_embeddings=32), "--max-position-embeddings 32 with --seq-length 16"),
        (dict(kv_channels=0), "--kv-channels 0: a head is at least 1 wide"),
        (
            dict(
                ckpt_format="torch_dist",
                save="ckpt",
                use_distributed_optimizer=True,
                pipeline_schedule="zb-v",
            ),
            "--ckpt-format torch_dist with --use-distributed-optimizer, --save and "
            "--pipeline-schedule zb-v",
        ),
        (  # zb-v's two chunks on one stage too (Megatron-LM's files there hold one)
            dict(ckpt_format="torch", save="ckpt", pipeline_schedule="zb-v"),
            "--ckpt-format torch with --save and --pipeline-schedule zb-v: Megatron-LM's legacy",
        ),
        (dict(overlap_param_gather=True), "add --use-distributed-optimizer"),
        (dict(mock_data=True, data_path="x"), "--mock-data and --data-path"),
    ],
)
def test_what_megart_cannot_do_is_refused_by_name_before_any_work(flags, match):
    with pytest.raises(ConfigError, match=match):
        tw.tiny(**flags).check(1)


def test_megatrons_legacy_files_are_refused_under_zb_v_at_pp2_and_read_under_it():
    """Rank r of zb-v holds stages r and 2p - 1 - r, which Megatron-LM's legacy files cannot
    hold (test_zero_bubble_resharding: convert-checkpoint writes Megatron's placement); loading
    such files under zb-v stays allowed."""
    zb_v = dict(ckpt_format="torch", pipeline_schedule="zb-v", pipeline_model_parallel_size=2)
    with pytest.raises(ConfigError, match="use --pipeline-schedule interleaved"):
        tw.tiny(**zb_v, save="ckpt").check(2)
    tw.tiny(**zb_v, load="ckpt").check(2)


def test_cli_refuses_context_parallelism_before_building_anything():
    status, out = mw.run_cli(["--context-parallel-size", "2"])
    assert status == 2 and "--context-parallel-size 2" in out and "iteration" not in out


def test_flags_that_change_nothing_here_are_accepted_and_keep_the_model():
    same = tw.tiny(
        max_position_embeddings=16, kv_channels=8, num_workers=4, log_throughput=True,
        create_attention_mask_in_dataloader=False, calculate_per_token_loss=True,
        distributed_timeout_minutes=3, attention_backend="flash",
    ).gpt_config()  # fmt: skip
    assert same == tw.tiny(attention_backend="flash").gpt_config()
    rope = tw.tiny(position_embedding_type="rope", max_position_embeddings=64)
    rope.check(1)  # rope has no table: a longer maximum is fine


def _copy_rows_halves_from_pairs(src: GPT, dst: GPT, cfg: GPTConfig) -> None:
    """dst = src with each head's q and k rows reordered from adjacent pairs (2i, 2i+1) to
    halves (i, i + d/2): rotating halves of the reordered projection is rotating pairs of
    the original, so the two models are the same function."""
    d = cfg.head_dim
    order = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    dst.load_state_dict(src.state_dict())
    heads, groups = cfg.num_attention_heads, cfg.query_groups
    per = heads // groups
    with torch.no_grad():
        for block in dst.chunk.blocks:
            for p in [block.attn.qkv.weight] + ([block.attn.qkv.bias] if cfg.bias else []):
                rows = p.view(groups, per + 2, d, *p.shape[1:])
                rows[:, : per + 1] = rows[:, : per + 1, order].clone()  # q heads and k, not v


@pytest.mark.parametrize("groups", [None, 2])
def test_rope_halves_equal_interleaved_pairs_after_reordering_the_rows(groups):
    kw = dict(vocab_size=64, seq_length=12, hidden_size=32, num_layers=2, num_attention_heads=4,
              position_embedding="rotary", num_query_groups=groups)  # fmt: skip
    pairs = GPT(GPTConfig(**kw, rotary_interleaved=True)).double()
    halves = GPT(GPTConfig(**kw)).double()
    _copy_rows_halves_from_pairs(pairs, halves, halves.cfg)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = pairs(tokens), halves(tokens)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    plain = GPT(GPTConfig(**kw)).double()
    plain.load_state_dict(pairs.state_dict())
    with torch.no_grad():
        assert not torch.allclose(plain(tokens), a, atol=1e-4)  # the rotation matters


def test_old_checkpoints_load_with_adjacent_pairs_and_new_ones_record_the_choice():
    old = {"config": {}, "model_config": {"position_embedding": "rotary", "hidden_size": 32,
                                          "num_attention_heads": 4}}  # fmt: skip
    assert checkpoint.model_config(old).rotary_interleaved
    new = {**old, "model_config": {**old["model_config"], "rotary_interleaved": False}}
    assert not checkpoint.model_config(new).rotary_interleaved


def test_mock_data_and_no_mmap_bin_files(gpt2_files):
    from megart.training.megatron_flags import mock_tokens

    c = tw.tiny(mock_data=True, vocab_size=100)
    tokens = mock_tokens(c)
    assert tokens.min() >= 0 and tokens.max() < 100
    assert np.array_equal(tokens, mock_tokens(tw.tiny(mock_data=True, vocab_size=100)))
    where, _ = gpt2_files
    mapped = IndexedTokens(where / "corpus_text_document").tokens
    read = IndexedTokens(where / "corpus_text_document", mmap=False).tokens
    assert isinstance(mapped, np.memmap) and not isinstance(read, np.memmap)
    assert np.array_equal(mapped, read)


def test_overlap_flags_follow_the_single_process_loss_curve():
    """--overlap-param-gather leaves each bucket's all-gather running after the step (each
    forward waits only for its own buckets); --no-overlap-grad-reduce reduces after backward.
    Both give the single-process loss curve."""
    reference = [h["loss"] for h in launch(tw.train_kw, 1, {}, timeout=300)[0]]
    zero = dict(use_distributed_optimizer=True, overlap_param_gather=True, eval_iters=1)
    for r in launch(mw.pending_gathers, 2, zero, timeout=300):
        assert r["losses"] == pytest.approx(reference, rel=1e-5)
        assert r["after_step"] == r["buckets"] > 0 and r["after_forward"] == 0
    for history in launch(tw.train_kw, 2, dict(overlap_grad_reduce=False), timeout=300):
        assert [h["loss"] for h in history] == pytest.approx(reference, rel=1e-5)


def test_loading_a_checkpoint_of_the_other_rotation_is_refused_naming_the_flag():
    c = tw.tiny(position_embedding_type="rope")
    layout = {f: getattr(c, f) for f in checkpoint.MODEL_FIELDS}
    old = {"config": layout, "model_config": {k: v for k, v in vars(c.gpt_config()).items()
                                              if k != "rotary_interleaved"}}  # fmt: skip
    with pytest.raises(ConfigError, match="--rotary-interleaved .*now --rotary-base 10000 \\(h"):
        checkpoint._check_model("ckpt", old, c, c.gpt_config())
    again = tw.tiny(position_embedding_type="rope", rotary_interleaved=True)
    checkpoint._check_model("ckpt", old, again, again.gpt_config())  # loads as it was trained
