"""megart plan with Megatron-LM's document flags (--reset-attention-mask, --reset-position-ids,
--eod-mask-loss; megart.plan.documents) against real megart train ranks (CPU, shared-memory
transport): the activations autograd saves at the peak, with the documents' masks and biases
counted for as long as they live (plan_workers._masks_held), within 1% as the other memory
cases, and what the flags add (the same run without them subtracted) within 0.1%: the mask
alone is a few percent of a rank's activations here, so that an error in it (per layer rather
than per pair, fp32 rather than 16-bit, the rows' padding) would hide inside 1%.

What a CPU measures here is what the plan counts for a GPU but for two storages the GPU copies
per microbatch and a CPU shares (cpu_shared_storages). The GPU's kernels are a model
(plan.documents' doc), not checked here."""

from __future__ import annotations

import dataclasses

import pytest

from megart.errors import ConfigError
from megart.launcher import launch
from megart.plan.documents import loss_mask_bytes, mask_bytes, with_end_of_document
from megart.plan.estimate import estimate
from megart.plan.hardware import load_profile
from megart.plan.layout import Layout, layout_config
from megart.plan.memory import precision, rank_memory
from megart.plan.timing import CAUSAL_SHARE, FLASH_BACKWARD, documents_mask_read, layer_work
from megart.training.config import TrainConfig
from plan_workers import document_corpus, held_bytes, plan_json
from test_plan_memory import _layout

GPU = load_profile("a100-80gb")
VOCAB = 255  # NullTokenizer's --vocab-size: 256 ids, the last its end-of-document token
DOC = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    # 40 keys: bias rows padded to 48 elements (window_masks.ALIGN)
    seq_length=40,
    vocab_size=VOCAB,
    tokenizer_type="NullTokenizer",
    global_batch_size=8,
    train_iters=2,
    lr_warmup_iters=1,
    eval_iters=0,
    hidden_dropout=0.0,
    attention_dropout=0.0,  # a CPU's math kernel otherwise (plan.documents)
)
MASK = dict(reset_attention_mask=True)
ROPE = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True)
PP2 = dict(pipeline_model_parallel_size=2)

# (name, processes, flags); fp32 at b 2, bf16 at b 4 (160 tokens a microbatch: no weight's
# dimension, see plan_workers.SavedBytes).
CASES = [
    ("pp1 fp32", 1, dict(MASK, micro_batch_size=2)),
    ("pp1 fp32 selective", 1, dict(MASK, micro_batch_size=2, recompute_granularity="selective")),
    ("pp1 fp32 full", 1, dict(MASK, micro_batch_size=2, recompute_granularity="full")),
    ("pp2 fp32", 2, dict(MASK, **PP2, micro_batch_size=2)),
    (
        "pp2 fp32 interleaved",
        2,
        dict(MASK, **PP2, micro_batch_size=2, num_layers_per_virtual_pipeline_stage=1),
    ),
    ("pp2 bf16", 2, dict(MASK, **PP2, bf16=True, micro_batch_size=4)),
    (
        "pp2 bf16 selective",
        2,
        dict(MASK, **PP2, bf16=True, micro_batch_size=4, recompute_granularity="selective"),
    ),
    (
        "pp2 bf16 full uniform 2",
        2,
        dict(
            MASK,
            **PP2,
            bf16=True,
            micro_batch_size=4,
            recompute_granularity="full",
            recompute_num_layers=2,
        ),
    ),
    (
        "pp2 bf16 half weights",
        2,
        dict(MASK, **PP2, bf16=True, half_weights=True, micro_batch_size=4),
    ),
    # Reset positions: rope's tables per sample; the learned table's index, and the loss mask.
    (
        "pp2 bf16 rope positions",
        2,
        dict(ROPE, **PP2, bf16=True, micro_batch_size=4, reset_position_ids=True),
    ),  # fmt: skip
    (
        "pp2 fp32 learned positions loss mask",
        2,
        dict(**PP2, micro_batch_size=2, reset_position_ids=True, eod_mask_loss=True),
    ),
    (
        "pp2 bf16 rope all three full",
        2,
        dict(
            ROPE,
            **PP2,
            **MASK,
            bf16=True,
            micro_batch_size=4,
            reset_position_ids=True,
            eod_mask_loss=True,
            recompute_granularity="full",
        ),
    ),  # fmt: skip
]

DOCUMENT_FLAGS = ("reset_attention_mask", "reset_position_ids", "eod_mask_loss")


def cpu_shared_storages(config: TrainConfig, layout: Layout, pp_rank: int, pairs: int) -> float:
    """What a CPU rank holds beyond the plan, which counts a GPU's: the learned table's index
    (--reset-position-ids) and the loss mask (--eod-mask-loss) are views of one tensor of the
    rank's whole share of the batch on a CPU (its microbatches are views of it), where a GPU
    copies each microbatch apart. The index on the first stage, of the ``pairs`` held; the
    loss mask on the last stage, one microbatch's at a time."""
    rows = config.global_batch_size // layout.dp  # the rank's samples this iteration
    b, s = layout.micro_batch, config.seq_length
    extra = 0.0
    learned = config.gpt_config().position_embedding == "learned"
    if config.reset_position_ids and learned and pp_rank == 0 and pairs:
        extra += rows * s * 8 - pairs * b * s * 8
    if config.eod_mask_loss and pp_rank == layout.pp - 1:
        extra += (rows - b) * s * 4
    return extra


def _measure(kw: dict, nproc: int) -> list[dict]:
    return launch(held_bytes, nproc, kw, document_corpus(VOCAB), timeout=300)


def _predicted(kw: dict, nproc: int, pp_rank: int) -> tuple[dict, float]:
    """(the plan's memory of ``pp_rank`` by part, the CPU's shared storages beyond it), of
    the config as megart plan makes its candidates from it: the vocabulary resolved once
    (NullTokenizer's would grow by one at each dataclasses.replace)."""
    config = with_end_of_document(dataclasses.replace(TrainConfig(**kw), tokenizer_type=None))
    layout = _layout(config, nproc)
    pairs = estimate(config, layout, GPU).peak_in_flight[pp_rank]
    c = layout_config(config, layout)
    parts = rank_memory(c, layout, layout.dp, pp_rank, pairs)
    return parts, cpu_shared_storages(config, layout, pp_rank, pairs)


@pytest.mark.parametrize("name,nproc,flags", CASES, ids=[c[0] for c in CASES])
def test_what_a_rank_holds_with_the_document_flags(name, nproc, flags):
    kw = {**DOC, **flags}
    plain = {k: v for k, v in kw.items() if k not in DOCUMENT_FLAGS}
    with_flags, without = _measure(kw, nproc), _measure(plain, nproc)
    for held, bare in zip(with_flags, without, strict=True):
        r = held["pp_rank"]
        want, cpu = _predicted(kw, nproc, r)
        saved = want["saved"] + cpu
        assert held["saved_peak"] == pytest.approx(saved, rel=0.01), (name, held, want)
        added = held["saved_peak"] - bare["saved_peak"]
        want_added = saved - _predicted(plain, nproc, r)[0]["saved"]
        assert added > 0 and added == pytest.approx(want_added, rel=1e-3), (name, r, added)
        # Full recomputation: what the flags add to a replay's moment (the loss's saves, among
        # them the loss mask, are freed before the last stage replays: plan.memory).
        last = r == nproc - 1 and kw.get("eod_mask_loss")
        if kw.get("recompute_granularity") == "full" and not last:
            top = saved + want["recompute_working"]
            bare_want = _predicted(plain, nproc, r)[0]
            top_added = top - bare_want["saved"] - bare_want["recompute_working"]
            rise = held["recompute_peak"] - bare["recompute_peak"]
            assert rise == pytest.approx(top_added, rel=1e-3), (name, r, rise, top_added)


def test_the_masks_bytes_by_granularity_and_dtype():
    """The rule, spelt out: a bias per pair (16-bit under autocast, rows padded to 16) and one
    boolean mask without recomputation; the other way round with it."""
    b, s = 3, 40
    for rec, bf16 in [(None, False), ("selective", True), ("full", False)]:
        c = TrainConfig(**{**DOC, **MASK, "seq_length": s, "bf16": bf16},
                        recompute_granularity=rec)  # fmt: skip
        bias = b * s * 48 * (2 if bf16 else 4)
        booleans = b * s * s
        want = (bias, booleans) if rec is None else (booleans, bias)
        assert mask_bytes(c, b, precision(c, "megart")) == want
    assert mask_bytes(TrainConfig(**DOC), b, precision(TrainConfig(**DOC), "megart")) == (0, 0)
    assert loss_mask_bytes(TrainConfig(**DOC, eod_mask_loss=True), b, 2) == b * 20 * 4 + 4


def _work(documents: bool, rec: str | None = None):
    cfg = TrainConfig(**{**DOC, "seq_length": 4096, "hidden_size": 1024, "num_attention_heads": 16,
                         "recompute_granularity": rec}).gpt_config()  # fmt: skip
    return layer_work(cfg, 2, 1, False, rec, GPU, documents=documents), cfg


@pytest.mark.parametrize("rec", [None, "selective", "full"])
def test_the_masked_layer_scores_every_entry_and_reads_the_bias(rec):
    """Each layer's attention under the documents' mask: all s x s products (flash's causal
    half otherwise), the backward recomputing the scores, and one read of the bias per pass
    (forward, backward, and the replayed forward under recomputation)."""
    from megart.plan.timing import gemm_seconds

    plain, cfg = _work(False, rec)
    masked, _ = _work(True, rec)
    s, d, heads = cfg.seq_length, cfg.head_dim, 2 * cfg.num_attention_heads
    core = gemm_seconds(s, s, d, GPU, heads) + gemm_seconds(s, d, s, GPU, heads)
    extra = core * (1 - CAUSAL_SHARE)
    read = documents_mask_read(s, 2, GPU)
    assert read == 2 * s * s * 2 / (GPU.hbm_gb_per_s * 1e9)  # 4096: no padding
    assert masked.forward - plain.forward == pytest.approx(extra + read)
    replay = {None: 0.0, "selective": extra + read, "full": extra + read}[rec]
    assert masked.backward - plain.backward == pytest.approx(FLASH_BACKWARD * extra + read + replay)


BIG = ("--gpu a100-80gb --num-gpus 8 --num-layers 8 --hidden-size 1024 --num-attention-heads 16 "
       "--seq-length 4096 --global-batch-size 64 --tokenizer-type NullTokenizer "
       "--vocab-size 32000 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 "
       "--micro-batch-size 1")  # fmt: skip


def test_the_cli_plans_the_mask_slower_and_larger_with_the_same_model_flops(capsys):
    plain = plan_json(BIG, capsys)
    masked = plan_json(BIG + " --reset-attention-mask", capsys)
    assert masked["iteration_time_s"] > plain["iteration_time_s"]
    assert masked["memory_gib"]["activations"] > plain["memory_gib"]["activations"]
    # Model FLOPs ignore the mask (training.flops, as Megatron-LM's count).
    assert masked["tflops_per_gpu"] * masked["iteration_time_s"] == pytest.approx(
        plain["tflops_per_gpu"] * plain["iteration_time_s"]
    )
    # Reset positions and the loss mask: accepted, a little more memory, no more time.
    both = plan_json(BIG + " --reset-position-ids --eod-mask-loss", capsys)
    assert both["iteration_time_s"] == plain["iteration_time_s"]
    assert both["memory_gib"]["activations"] > plain["memory_gib"]["activations"]


def test_context_parallelism_is_searched_at_1_only_with_the_mask(capsys):
    cp_free = BIG.replace("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 ", "")
    searched = plan_json(cp_free + " --top 100", capsys)
    assert any(c["layout"]["cp"] > 1 for c in searched["candidates"])
    masked = plan_json(cp_free + " --top 100 --reset-attention-mask", capsys)
    assert {c["layout"]["cp"] for c in masked["candidates"]} == {1}


def _refusal(main, argv: str, capsys) -> str:
    assert main(argv.split()) == 2
    return capsys.readouterr().err.split("error: ", 1)[1].strip()


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_the_mask_with_context_parallelism_is_refused_in_megart_trains_words(capsys, comm):
    from megart.cli.plan import main as plan_main

    flags = dict(DOC, **MASK, context_parallel_size=2, cp_comm_type=comm)
    with pytest.raises(ConfigError) as train:
        TrainConfig(**flags).check(2)
    argv = (f"--gpu a100-80gb --num-gpus 2 --num-layers 4 --hidden-size 64 "
            f"--num-attention-heads 4 --seq-length 40 --global-batch-size 8 "
            f"--tokenizer-type NullTokenizer --vocab-size {VOCAB} --reset-attention-mask "
            f"--context-parallel-size 2 --cp-comm-type {comm}")  # fmt: skip
    assert _refusal(plan_main, argv, capsys) == str(train.value)


def test_what_megart_train_refuses_of_the_flags_the_plan_refuses_alike(capsys):
    """No tokenizer (no end-of-document id), and --no-create-attention-mask-in-dataloader."""
    from megart.cli.plan import main as plan_main

    base = ("--gpu a100-80gb --num-gpus 2 --num-layers 4 --hidden-size 64 "
            "--num-attention-heads 4 --seq-length 40 --global-batch-size 8")  # fmt: skip
    for extra, kw in [
        ("--reset-attention-mask", dict(reset_attention_mask=True)),
        ("--eod-mask-loss", dict(eod_mask_loss=True)),
        (
            f"--tokenizer-type NullTokenizer --vocab-size {VOCAB} --reset-attention-mask "
            "--no-create-attention-mask-in-dataloader",
            dict(
                tokenizer_type="NullTokenizer",
                vocab_size=VOCAB,
                reset_attention_mask=True,
                create_attention_mask_in_dataloader=False,
            ),
        ),  # fmt: skip
    ]:
        config = dataclasses.replace(TrainConfig(**{**DOC, "tokenizer_type": None}), **kw)
        with pytest.raises(ConfigError) as train:
            config.check(1)
        assert _refusal(plan_main, f"{base} {extra}", capsys) == str(train.value)


def test_a_window_with_the_mask_is_refused_as_unmodelled(capsys):
    from megart.cli.plan import main as plan_main

    argv = BIG + " --reset-attention-mask --window-size 255,0"
    says = _refusal(plan_main, argv, capsys)
    assert "does not model --reset-attention-mask with --window-size 255,0" in says
    # A window covering the sequence masks nothing: planned.
    assert plan_main((BIG + " --reset-attention-mask --window-size 4095,0 --json").split()) == 0
    capsys.readouterr()
    says = _refusal(plan_main, BIG + " --reset-attention-mask --runtime megatron", capsys)
    assert "--reset-attention-mask (with --runtime megatron)" in says
