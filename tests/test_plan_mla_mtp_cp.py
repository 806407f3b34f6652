"""megart plan with multi-latent attention (plan.mla_cp) and multi-token prediction
(plan.mtp_memory, plan.mtp_time) under context parallelism, every --cp-comm-type, against real
megart train ranks: parameter, gradient and optimizer bytes exactly (cp2, tp2 x cp2); the
activations autograd saves at the peak (torch's saved-tensor hooks): MLA's to the byte in fp32
(the all-gather's CPU-only causal mask aside, tests/test_plan_context_parallel.cpu_mask), the
prediction depths' within 1% (their losses' few bytes a token are not counted); and each
exchange a real step posts (the ring's padded K/V blocks, the all-gathers and all-to-alls at
MLA's own widths, the depths' gathers of tokens, labels and loss mask) with the bytes each
rank's transport sent its peers. The deliberate mistakes the checks exist for (values at the
keys' width, depths not split over cp) are shown to fail them."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from megart.launcher import launch
from megart.models.config import GPTConfig
from megart.models.mla_checks import MLA_DEFAULTS
from megart.plan.collectives import collective_seconds
from megart.plan.context_parallel import a2a_exchanges, kv_gathers, ring_passes
from megart.plan.hardware import load_profile
from megart.plan.memory import precision
from megart.plan.moe_memory import MoeRank
from megart.plan.mtp_memory import mtp_stage_bytes
from megart.plan.mtp_time import mtp_sequence_gathers, mtp_work
from megart.plan.timing import layer_work
from megart.training.config import TrainConfig
from plan_exchange_workers import a2a_traffic, cp_traffic
from plan_memory_check import (
    _layout,
    assert_rank_matches,
    deferred_and_predicted,
    predicted_and_held,
)
from plan_workers import held_bytes
from test_plan_context_parallel import cpu_mask
from test_plan_memory_mla import MLA, MTP, Q_LORA

CP2 = dict(context_parallel_size=2)
TP2_CP2_SP = dict(CP2, tensor_model_parallel_size=2, sequence_parallel=True)
LEARNED = dict(position_embedding_type="learned_absolute")
# (world, name, flags, exact activations: True, or within 1%)
MEMORY = [
    (2, "mla p2p", dict(MLA, **CP2), True),
    (2, "mla p2p narrow values", dict(MLA, **CP2, v_head_dim=8), True),  # padded in the ring
    (2, "mla a2a", dict(MLA, **CP2, cp_comm_type="a2a"), True),
    (2, "mla all_gather", dict(MLA, **CP2, cp_comm_type="all_gather"), True),
    (2, "mla all_gather selective", dict(MLA, **CP2, cp_comm_type="all_gather",
                                         recompute_granularity="selective"), True),
    (2, "mla a2a selective", dict(MLA, **CP2, cp_comm_type="a2a",
                                  recompute_granularity="selective"), True),
    (2, "mtp p2p", dict(MTP, **CP2), False),
    (2, "mtp a2a", dict(MTP, **CP2, cp_comm_type="a2a"), False),
    # Learned positions: the all-gather's rope terms are unaudited (test_plan_context_parallel)
    (2, "mtp all_gather", dict(MTP, **CP2, **LEARNED, cp_comm_type="all_gather"), False),
    (2, "mtp full uniform", dict(MTP, **CP2, recompute_granularity="full",
                                 recompute_method="uniform", recompute_num_layers=1), False),
    (4, "mtp mla tp2 x cp2 sp", dict(MLA, mtp_num_layers=1, **TP2_CP2_SP), False),
    (4, "mla q-lora tp2 x cp2 a2a", dict(Q_LORA, **CP2, tensor_model_parallel_size=2,
                                         cp_comm_type="a2a"), True),
]  # fmt: skip


def _held_in_turn(runs: list[dict]) -> list[dict]:
    return [held_bytes(kw) for kw in runs]


def _by_world(cases: list[tuple], worker, worlds: tuple[int, ...]) -> list[list[dict]]:
    """Per case (world first, flags third), what each of its ranks measured by ``worker`` (a
    list of flags in turn), one launch per world size."""
    out: dict[int, list[dict]] = {}
    for world in worlds:
        index = [i for i, case in enumerate(cases) if case[0] == world]
        per_rank = launch(worker, world, [cases[i][2] for i in index], timeout=900)
        for i, ranks in zip(index, zip(*per_rank, strict=True), strict=True):
            out[i] = list(ranks)
    return [out[i] for i in range(len(cases))]


@pytest.fixture(scope="module")
def held() -> list[list[dict]]:
    return _by_world(MEMORY, _held_in_turn, (2, 4))


@pytest.mark.parametrize("case", range(len(MEMORY)), ids=[c[1] for c in MEMORY])
def test_predicted_bytes_are_what_a_cp_rank_holds(case, held):
    world, name, kw, exact = MEMORY[case]
    for rank, want, cpu in predicted_and_held(world, kw, ranks=held[case]):
        c = TrainConfig(**kw)  # the all-gather's CPU mask, one microbatch in flight (pp1)
        mask = cpu_mask(c, 1) if c.cp_comm_type == "all_gather" else 0.0
        assert_rank_matches(name, rank, want, cpu + mask, exact)
        if kw.get("mtp_num_layers") and not kw.get("recompute_granularity"):
            # The deliberate mistake: the depths counted over the whole sequence (not split
            # over cp) puts the prediction far above what the rank holds (measured: 41% over).
            c = TrainConfig(**kw)
            args = (c.gpt_config(), c.micro_batch_size, c.tp, c.sequence_parallel)
            prec = precision(c, "megart")
            split = mtp_stage_bytes(*args, prec, MoeRank(prec, 2, 4, c.tp, c.sequence_parallel))
            whole = mtp_stage_bytes(*args, prec, MoeRank(prec, 1, 4, c.tp, c.sequence_parallel))
            wrong = want["saved"] - split[0] + whole[0]
            assert wrong > 1.2 * rank["saved_peak"], (name, wrong, rank["saved_peak"])


ZERO_BUBBLE = [
    dict(MTP, **CP2, pipeline_model_parallel_size=2, pipeline_schedule="zb-h1"),
    dict(MLA, **CP2, mtp_num_layers=1, pipeline_model_parallel_size=2, pipeline_schedule="zb-h1",
         cp_comm_type="a2a"),
]  # fmt: skip


@pytest.mark.parametrize("kw", ZERO_BUBBLE, ids=["mtp p2p", "mla mtp a2a"])
def test_the_deferred_weight_gradients_are_what_a_cp_rank_keeps(kw):
    """cp2 x pp2 under zb-h1: the most bytes a rank keeps between its Is and Ws, the depths'
    over its s/cp tokens (mtp_weight_grad_bytes with cp), to the byte."""
    for peak, want in deferred_and_predicted(4, kw):
        assert peak == want, (kw, peak, want)


# --- exchanges ----------------------------------------------------------------------------

# Keys 24 wide (qk_head_dim 20 + the rope part 4), values 16: the ring pads them to 24.
WIDE = dict(MLA, qk_head_dim=20, v_head_dim=16, **CP2)
EXCHANGES = [
    (2, f"mla {comm} {rec}", dict(WIDE, cp_comm_type=comm, recompute_granularity=rec))
    for comm in ("p2p", "all_gather", "a2a")
    for rec in (None, "selective", "full")
] + [
    (2, "mtp p2p", dict(MTP, **CP2)),
    (2, "mtp all_gather", dict(MTP, **CP2, **LEARNED, cp_comm_type="all_gather")),
    (2, "mtp a2a", dict(MTP, **CP2, cp_comm_type="a2a")),
]


def _traffic_in_turn(runs: list[dict]) -> list[dict]:
    return [(a2a_traffic if kw.get("cp_comm_type") == "a2a" else cp_traffic)(kw) for kw in runs]


@pytest.fixture(scope="module")
def traffic() -> list[list[dict]]:
    return _by_world(EXCHANGES, _traffic_in_turn, (2,))


def _planned(config: TrainConfig, world: int, cfg: GPTConfig | None = None) -> Counter:
    """One step's exchanges on a rank as the plan counts them, as the workers record them (fp32
    runs: 4-byte K/V; ``cfg``: another model's count): per layer (the depths' too) and
    microbatch the ring's passes, the all-gathers and reduce-scatters, or the all-to-alls'
    buffers; and the depths' gathers."""
    cfg, lay = cfg or config.gpt_config(), _layout(config, world)
    mb = config.microbatches(lay.dp)
    layers = (cfg.num_layers // lay.pp + (cfg.mtp_num_layers or 0)) * mb
    args = (cfg, lay.micro_batch, lay.tp, lay.cp, lay.recompute)
    want: Counter = Counter()
    if cfg.cp_comm_type == "a2a":
        for n in a2a_exchanges(*args).all:
            want[(n, 4)] += layers
        return want
    for n, size in mtp_sequence_gathers(cfg, lay.micro_batch, lay.cp):
        want[("forward", "all_gather", n, size)] += mb
    if cfg.cp_comm_type == "p2p":
        r = ring_passes(*args)
        want[("forward", "p2p", r.block, 4)] += r.forward * layers
        want[("backward", "p2p", r.block, 4)] += (r.backward + r.replayed + r.grads) * layers
        return want
    g = kv_gathers(*args)
    for whole in (g.keys, g.values):
        part = whole / lay.cp
        want[("forward", "all_gather", part, 4)] += g.forward * layers
        want[("backward", "all_gather", part, 4)] += g.replayed * layers
        want[("backward", "reduce_scatter", part, 4)] += g.backward * layers
    return want


def _sent(want: Counter, a2a: bool, cp: int) -> float:
    """The bytes a rank sends each peer: the ring's passes to its next rank; 1/cp of each
    all-to-all's buffer to every other rank."""
    if a2a:
        return sum(n * size * k for (n, size), k in want.items()) / cp
    return sum(n * size * k for (_, kind, n, size), k in want.items() if kind == "p2p")


def _mistaken(config: TrainConfig) -> list:
    """The deliberate mistakes: MLA's exchanges at an ordinary attention's widths (what the
    plan counted before), and the values at the keys' width (no narrower values)."""
    cfg = config.gpt_config()
    if not cfg.multi_latent_attention:
        return []
    keys = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
    return [dataclasses.replace(cfg, multi_latent_attention=False, **MLA_DEFAULTS),
            dataclasses.replace(cfg, v_head_dim=keys)]  # fmt: skip


@pytest.mark.parametrize("case", range(len(EXCHANGES)), ids=[c[1] for c in EXCHANGES])
def test_the_planned_exchanges_are_those_a_real_step_posts(case, traffic):
    """Every exchange of a real step of the plan's count and size, and the bytes each rank's
    transport sent: the ring's to its next rank, the all-to-all's 1/cp of each buffer to each
    peer, none point to point under the all-gather. The mistakes' counts differ (MLA)."""
    world, name, kw = EXCHANGES[case]
    config = TrainConfig(**kw)
    want = +_planned(config, world)
    comm = config.cp_comm_type
    for rank in traffic[case]:
        got = Counter(tuple(c) for c in rank["calls"])
        assert got == want, (name, rank["calls"])
        sent = list(rank["sent"].values())
        if comm == "all_gather":
            assert sent == [], name
        else:  # world 2: one peer
            assert sent == [pytest.approx(_sent(want, comm == "a2a", 2), rel=1e-12)], name
        for cfg in _mistaken(config):
            wrong = +_planned(config, world, cfg)
            if comm != "p2p" or not cfg.multi_latent_attention:  # the ring pads: the same
                assert got != wrong, (name, cfg)


# --- time ---------------------------------------------------------------------------------


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_the_depths_time_runs_the_decoders_exchanges_and_their_gathers(comm):
    """Under cp each depth's layer is the decoder's at cp (its exchanges, s/cp tokens), and the
    depths' gathers (tokens, labels, loss mask) come once per microbatch, forward only."""
    cfg = TrainConfig(**dict(MTP, **CP2, cp_comm_type=comm, seq_length=4096)).gpt_config()
    gpu = load_profile("h100-80gb")
    w = mtp_work(cfg, 2, 1, False, gpu, gpu, cp=2)
    layer = layer_work(cfg, 2, 1, False, None, gpu, cp=2)
    shifts = sum(collective_seconds("all_gather", n * size, 2, gpu.nvlink_bus_gb_per_s, gpu)
                 for n, size in mtp_sequence_gathers(cfg, 2, 2))  # fmt: skip
    assert shifts > 0 and layer.cp_comm > 0
    assert w.cp_comm == pytest.approx(2 * layer.cp_comm + shifts, rel=1e-12)
    # Split over cp: the weight-gradient products over half the whole sequence's tokens.
    assert w.weight == pytest.approx(mtp_work(cfg, 2, 1, False, gpu, gpu).weight / 2, rel=1e-9)
