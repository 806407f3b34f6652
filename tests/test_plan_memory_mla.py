"""megart plan with multi-latent attention (plan.mla_memory, plan.mla_time) and multi-token
prediction (plan.mtp_memory, plan.mtp_time): parameter, gradient and optimizer bytes against
real megart train ranks exactly, and the activations autograd saves at the peak (torch's
saved-tensor hooks): MLA's exactly in fp32 (tp1, tp2 with and without sequence parallelism, pp2,
--q-lora-rank, --qk-layernorm, selective and full recomputation), within 1% in bf16 (the dense
layers' known CPU differences, tests/test_plan_memory.py); the prediction depths' within 1%
(their losses' few bytes a token are not counted). The MLA models give v_head_dim =
qk_head_dim + qk_pos_emb_head_dim: other widths send a CPU to torch's math kernel, which keeps
s x s scores a GPU's memory-efficient kernel does not. And the CLI: both plan, refused where
not modelled."""

from __future__ import annotations

import json

import pytest

from megart.cli.main import main as megart_main
from megart.plan import activations as act
from megart.plan.memory import precision
from megart.plan.mtp_memory import mtp_loss_bytes
from megart.training.config import TrainConfig
from plan_memory_check import SMALL, assert_rank_matches, predicted_and_held

# 96 tokens a microbatch (3 x 32): no bf16 activation is shaped as a weight (SavedBytes).
ROPE = dict(SMALL, position_embedding_type="rope", global_batch_size=12, micro_batch_size=3)
MLA = dict(ROPE, multi_latent_attention=True, rope_type="rope", kv_lora_rank=24, qk_head_dim=12,
           qk_pos_emb_head_dim=4, v_head_dim=16)  # fmt: skip
Q_LORA = dict(MLA, q_lora_rank=40)
TP2 = dict(tensor_model_parallel_size=2)
PP2 = dict(pipeline_model_parallel_size=2)
MTP = dict(ROPE, mtp_num_layers=2)
FULL_UNIFORM = dict(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=1)  # fmt: skip

# (name, processes, flags, exact activations: True, or within 1% (False))
CASES = [
    ("mla", 1, MLA, True),
    ("mla q-lora qk-layernorm", 1, dict(Q_LORA, qk_layernorm=True), True),
    ("mla tp2", 2, dict(MLA, **TP2), True),
    ("mla tp2 q-lora", 2, dict(Q_LORA, **TP2), True),
    ("mla tp2 sp q-lora qk-layernorm", 2, dict(Q_LORA, **TP2, sequence_parallel=True,
                                               qk_layernorm=True), True),
    ("mla tp2 sp rmsnorm qk-layernorm", 2, dict(MLA, **TP2, sequence_parallel=True,
                                                qk_layernorm=True, normalization="RMSNorm"), True),
    ("mla pp2 selective", 2, dict(MLA, **PP2, recompute_granularity="selective"), True),
    ("mla pp2 q-lora full block", 2, dict(Q_LORA, **PP2, recompute_granularity="full",
                                          recompute_method="block"), True),
    ("mla q-lora full uniform 2", 1, dict(Q_LORA, recompute_granularity="full",
                                          recompute_num_layers=2), True),
    ("mla bf16 rmsnorm q-lora qk-layernorm", 1, dict(Q_LORA, bf16=True, qk_layernorm=True,
                                                     normalization="RMSNorm"), False),
    ("mtp tied", 1, MTP, False),
    ("mtp untied", 1, dict(MTP, untie_embeddings_and_output_weights=True), False),
    ("mtp pp2 tied", 2, dict(MTP, **PP2), False),
    ("mtp pp2 untied", 2, dict(MTP, **PP2, untie_embeddings_and_output_weights=True), False),
    ("mtp full uniform", 1, dict(MTP, **FULL_UNIFORM), False),
    ("mtp pp2 full block", 2, dict(MTP, **PP2, recompute_granularity="full",
                                   recompute_method="block"), False),
    ("mtp mla tp2 sp", 2, dict(MLA, mtp_num_layers=1, **TP2, sequence_parallel=True), False),
    ("mtp dp2 distributed optimizer", 2, dict(MTP, use_distributed_optimizer=True), False),
    ("mtp learned positions", 1, dict(MTP, position_embedding_type="learned_absolute"), False),
    ("mtp hidden dropout", 1, dict(MTP, hidden_dropout=0.1), False),
    ("mtp pp2 interleaved", 2, dict(MTP, **PP2, num_layers_per_virtual_pipeline_stage=1), False),
    ("mtp tp2 sp bf16", 2, dict(MTP, **TP2, sequence_parallel=True, bf16=True), False),
    ("mla tp2 sp bf16 hidden dropout", 2, dict(MLA, **TP2, sequence_parallel=True, bf16=True,
                                               hidden_dropout=0.1), False),
]  # fmt: skip


@pytest.mark.parametrize("name,nproc,kw,exact", CASES, ids=[c[0] for c in CASES])
def test_predicted_mla_and_mtp_bytes_are_what_a_rank_holds(name, nproc, kw, exact):
    for held, want, cpu in predicted_and_held(nproc, kw):
        assert_rank_matches(name, held, want, cpu, exact)
        if kw.get("recompute_granularity") == "full" and kw.get("recompute_method") != "block":
            # one stage: the loss's rank; the replay's peak as the plan has it
            c = TrainConfig(**kw)
            where = (c.gpt_config(), c.micro_batch_size, c.tp, c.sequence_parallel,
                     precision(c, "megart"))  # fmt: skip
            # The loss's saves (the depths' output layer's and loss's too) are freed first.
            loss = act.last_stage_bytes(*where) + mtp_loss_bytes(*where)
            peak = want["saved"] - loss + want["recompute_working"]
            # The depths' lookups' int64 ids stay held, and a depth replays before the
            # model's layers: within 5%.
            rel = 0.05 if c.mtp_num_layers else 0.01
            assert held["recompute_peak"] == pytest.approx(peak, rel=rel), (name, held, want)


ARGV = (
    "plan --gpu h100-80gb --num-gpus 8 --num-layers 8 --hidden-size 1024 "
    "--num-attention-heads 16 --seq-length 2048 --global-batch-size 64 "
    "--position-embedding-type rope --disable-bias-linear --json --top 200"
)
MLA_ARGV = (
    "--multi-latent-attention --rope-type rope --kv-lora-rank 128 --qk-head-dim 64 "
    "--qk-pos-emb-head-dim 32 --v-head-dim 64"
)


def _plan(capsys, argv: str) -> dict:
    assert megart_main(argv.split()) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "extra",
    [MLA_ARGV, "--mtp-num-layers 2", f"{MLA_ARGV} --mtp-num-layers 1",
     "--mtp-num-layers 1 --num-experts 4"],
    ids=["mla", "mtp", "mla-mtp", "mtp-moe"],
)  # fmt: skip
def test_the_cli_plans_mla_and_mtp_layouts(extra, capsys):
    """Both plan over t, p, recomputation and the schedules, the zero-bubble ones too
    (tests/test_plan_mla_zero_bubble.py) but with experts (not modelled), and their FLOPs
    count in TFLOP/s (training.flops); MoE depths too (tests/test_plan_mtp_moe.py)."""
    out = _plan(capsys, f"{ARGV} {extra}")
    layouts = [c["layout"] for c in out["candidates"]]
    assert any(lay["pp"] > 1 for lay in layouts) and any(lay["tp"] > 1 for lay in layouts)
    zero_bubble = [lay for lay in layouts if lay["schedule"] in ("zb-h1", "zb-v")]
    assert bool(zero_bubble) == ("--num-experts" not in extra), zero_bubble
    assert out["tflops_per_gpu"] >= out["model_tflops_per_gpu"] > 0


def test_mla_and_mtp_change_the_time_and_memory_of_a_layout(capsys):
    """On one layout (tp2 with sequence parallelism, pp2): MLA's narrower heads and latents
    hold fewer parameters than multi-head attention's h x 3h and h x h, and its latents' gathers
    add tensor-parallel time; the depths add parameters, activations and time to the last
    stage, which becomes the rank that holds the most."""
    fixed = (f"{ARGV} --tensor-model-parallel-size 2 --sequence-parallel "
             "--pipeline-model-parallel-size 2 --micro-batch-size 1 "
             "--recompute-granularity selective")  # fmt: skip
    dense, mla = _plan(capsys, fixed), _plan(capsys, f"{fixed} {MLA_ARGV}")
    assert mla["memory_gib"]["parameters"] < dense["memory_gib"]["parameters"]
    assert mla["time_s"]["tp_comm"] > dense["time_s"]["tp_comm"]
    mtp = _plan(capsys, f"{fixed} --mtp-num-layers 1")
    # The worst rank is then the last (its parts are reported): more in all.
    for part in ("parameters", "total"):
        assert mtp["memory_gib"][part] > dense["memory_gib"][part], part
    assert mtp["iteration_time_s"] > dense["iteration_time_s"]


@pytest.mark.parametrize(
    "extra,says",
    [
        (f"{MLA_ARGV} --runtime megatron", "--multi-latent-attention (with --runtime megatron)"),
        ("--mtp-num-layers 1 --runtime megatron", "--mtp-num-layers 1 (with --runtime megatron)"),
        ("--mtp-num-layers 1 --reset-position-ids", "--reset-position-ids with --mtp-num-layers"),
    ],
    ids=["mla-megatron", "mtp-megatron", "mtp-documents"],
)  # fmt: skip
def test_the_cli_refuses_what_it_does_not_model_with_mla_or_mtp(extra, says, capsys):
    assert megart_main(f"{ARGV} {extra}".split()) == 2
    err = capsys.readouterr().err
    assert says in err and "megart plan does not model" in err, err
