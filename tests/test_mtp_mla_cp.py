"""Multi-token prediction (--mtp-num-layers, models.mtp) and multi-latent attention
(--multi-latent-attention, models.mla) under context parallelism, with every --cp-comm-type
(p2p, all_gather, a2a): whole models at cp2 and cp4 (and tp2 x cp2 with sequence parallelism)
are the one-process model, float64 (logits, depth losses, gradients); the attention of
DeepSeek-shaped heads (values narrower than queries and keys, a softmax scale of their own) by
each exchange is one process's; `megart train` follows the one-process curve at cp2 with each
exchange, at tp2 x cp2 with sequence parallelism and at cp2 x pp2; planted mistakes (the
depths' shifts within each rank's chunks, or over the ranks' parts in rank order,
Megatron-Core's per-rank count, YaRN's scale dropped) are caught; megart plan plans them."""

import json

import pytest

import mtp_cp_workers as cw
import train_workers as tw
from megart.launcher import launch

F64_REL = 1e-12
COMMS = ["p2p", "all_gather", "a2a"]
SIZES = dict(kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)
BASE = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
            position_embedding="rotary", init_std=0.5)  # fmt: skip
MLA = dict(BASE, multi_latent_attention=True, **SIZES)
YARN = dict(rope_type="yarn", yarn_rotary_scaling_factor=40.0, yarn_mscale=1.0,
            yarn_mscale_all_dim=1.0)  # fmt: skip
MODELS = {
    "mtp": dict(BASE, mtp_num_layers=2),
    "mtp-learned-untied": dict(
        BASE,
        position_embedding="learned",
        mtp_num_layers=2,
        untie_embeddings_and_output_weights=True,
    ),  # fmt: skip
    # Positions restarting after each end-of-document token (--reset-position-ids), learned.
    "mtp-reset-positions": dict(
        BASE, position_embedding="learned", mtp_num_layers=2, reset_positions=True
    ),  # fmt: skip
    "mla": MLA,
    "mla-yarn-mtp": dict(MLA, q_lora_rank=10, qk_layernorm=True, mtp_num_layers=2, **YARN),
}


def _worst(results: list[dict]) -> dict[str, float]:
    worst: dict[str, float] = {}
    for r in results:
        for k, v in r.items():
            worst[k] = max(worst.get(k, 0.0), v)
    return worst


def test_models_at_cp2_and_cp4_are_the_one_process_model():
    worst = _worst(launch(cw.against_one_process, 4, MODELS, COMMS, timeout=300))
    assert len(worst) == len(MODELS) * 3 * 2 * 3 - 3 * 2  # every model, exchange, size, figure
    assert max(worst.values()) < F64_REL, worst


@pytest.mark.parametrize(
    "mistake, model, moved",
    [
        ("local", "mtp", "logits"),  # each rank's part shifted as if it were the sequence
        ("rank-order", "mtp", "logits"),  # the load-balanced split forgotten
        ("own-count", "mtp", "depths"),  # Megatron-Core 0.16.1's normalisation
        ("no-scale", "mla-yarn-mtp", "logits"),
    ],
)
def test_planted_mistakes_move_the_model_far_beyond_the_tolerance(mistake, model, moved):
    """Measured when written (largest relative difference, cp2 / cp4): local 1.1 / 1.5 of the
    logits, rank-order 1.1 / 1.4, own-count 5e-3 / 5e-2 of the depth losses (2e-1 / 7e-1 of
    the gradients)."""
    args = ({model: MODELS[model]}, ["all_gather"], mistake)
    worst = _worst(launch(cw.against_one_process, 4, *args, timeout=300))
    for size in (2, 4):
        assert worst[f"{model} all_gather cp{size} {moved}"] > 1e-3, worst


@pytest.mark.parametrize("comm", COMMS)
def test_tp2_cp2_with_sequence_parallelism_is_the_one_process_model(comm):
    models = {k: MODELS[k] for k in ("mtp-learned-untied", "mla-yarn-mtp")}
    worst = launch(cw.tp_sp_against_one_process, 4, models, comm, timeout=300)
    assert max(max(r.values()) for r in worst) < F64_REL, worst


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("scale", [0.3, None])
@pytest.mark.parametrize(
    "comm, blocks",
    [("p2p", "flash"), ("p2p", "explicit"), ("all_gather", "auto"), ("all_gather", "blockwise"),
     ("a2a", "auto")],
)  # fmt: skip
def test_narrow_values_attend_as_one_process_through_every_exchange(comm, blocks, scale, cp):
    """Values 6 wide beside queries and keys 12 wide (the ring pads them to travel and drops
    the padding's output), a softmax scale of their own or the default."""
    for r in launch(cw.latent_attention, cp, comm, blocks, scale, timeout=120):
        assert max(r.values()) < F64_REL, r


# megart train's flags (TrainConfig's fields).
MTP_TRAIN = dict(position_embedding_type="rope", mtp_num_layers=2, train_iters=4)
MLA_TRAIN = dict(multi_latent_attention=True, rope_type="rope", position_embedding_type="rope",
                 q_lora_rank=16, qk_layernorm=True, normalization="RMSNorm", swiglu=True,
                 disable_bias_linear=True, train_iters=4, **SIZES)  # fmt: skip
TRAIN = {
    "mtp": (MTP_TRAIN, ("loss", "grad_norm", "mtp_1 loss", "mtp_2 loss")),
    "mla": (MLA_TRAIN, ("loss", "grad_norm")),
    "mla-mtp": (dict(MLA_TRAIN, mtp_num_layers=2, rope_type="yarn", rotary_scaling_factor=40.0,
                     mscale=0.9, mscale_all_dim=3.0, yarn_original_max_position_embeddings=4),
                ("loss", "grad_norm", "mtp_1 loss", "mtp_2 loss")),
}  # fmt: skip


def _curve(history: list[dict], names: tuple[str, ...]) -> list[float]:
    return [h[n] for h in history for n in names]


@pytest.fixture(scope="module")
def one_process():
    return {
        name: launch(tw.train_kw, 1, kw, timeout=300, env=tw.ONE_THREAD)[0]
        for name, (kw, _) in TRAIN.items()
    }


@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("model", list(TRAIN))
def test_megart_train_at_cp2_follows_the_one_process_curve(one_process, model, comm):
    kw, names = TRAIN[model]
    want = _curve(one_process[model], names)
    run = dict(kw, context_parallel_size=2, cp_comm_type=comm)
    for rank in launch(tw.train_kw, 2, run, timeout=300):
        assert _curve(rank, names) == pytest.approx(want, rel=5e-6)


@pytest.mark.parametrize(
    "layout, comm",
    [
        (dict(tensor_model_parallel_size=2, sequence_parallel=True), "p2p"),
        (dict(tensor_model_parallel_size=2, sequence_parallel=True), "a2a"),
        (dict(pipeline_model_parallel_size=2), "p2p"),
        (dict(pipeline_model_parallel_size=2), "all_gather"),
    ],
    ids=["tp2-sp-p2p", "tp2-sp-a2a", "pp2-p2p", "pp2-all_gather"],
)
def test_megart_train_at_cp2_with_tp2_or_pp2_follows_the_one_process_curve(
    one_process, layout, comm
):
    """MLA with YaRN and two depths: under pp2 the last stage reads the tokens from the labels
    (each rank's part) and shifts them along the whole sequence."""
    kw, names = TRAIN["mla-mtp"]
    want = _curve(one_process["mla-mtp"], names)
    run = dict(kw, context_parallel_size=2, cp_comm_type=comm, **layout)
    for rank in launch(tw.train_kw, 4, run, timeout=300):
        assert _curve(rank, names) == pytest.approx(want, rel=5e-6)


@pytest.mark.parametrize("mistake", ["local", "own-count"])
def test_planted_mistakes_move_megart_trains_curve_far_beyond_the_tolerance(one_process, mistake):
    """Measured when written (largest relative difference over loss, gradient norm and depth
    losses; correct: 7e-8): local 2e-3, rank-order 1e-3, own-count (Megatron-Core 0.16.1's
    per-rank count) 7e-4; the main loss alone moves 2e-6 to 2e-5."""
    kw, names = TRAIN["mtp"]
    want = _curve(one_process["mtp"], names)
    run = dict(kw, context_parallel_size=2)
    got = _curve(launch(cw.train_with_mistake, 2, run, mistake, timeout=300)[0], names)
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)) > 100 * 5e-6


PLAN = ["--gpu", "a100-80gb", "--num-gpus", "16", "--json", "--top", "50", "--num-layers", "8",
        "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "16384",
        "--vocab-size", "50257", "--global-batch-size", "16", "--position-embedding-type",
        "rope"]  # fmt: skip


@pytest.mark.parametrize("flags", [["--multi-latent-attention"], ["--mtp-num-layers", "1"]])
def test_megart_plan_plans_them_under_context_parallelism(flags, capsys):
    """Given, planned at that cp (plan.mla_cp, plan.mtp_memory; checked against real ranks in
    tests/test_plan_mla_mtp_cp.py); searched, cp > 1 among the candidates, as for the plain
    model (whose search proposes cp > 1 here)."""
    from megart.cli.plan import main

    assert main([*PLAN, *flags, "--context-parallel-size", "2"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert {c["layout"]["cp"] for c in [given, *given["candidates"]]} == {2}
    assert "--context-parallel-size 2" in given["layout"]["flags"]
    cps = {}
    for name, extra in (("plain", []), ("latent", flags)):
        assert main([*PLAN, *extra]) == 0
        found = json.loads(capsys.readouterr().out)
        cps[name] = {c["layout"]["cp"] for c in [found, *found["candidates"]]}
    assert max(cps["latent"]) > 1 and max(cps["plain"]) > 1, cps
