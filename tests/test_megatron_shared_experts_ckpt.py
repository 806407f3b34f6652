"""Shared experts (--moe-shared-expert-intermediate-size, gated by --moe-shared-expert-gate or
not) in Megatron-LM's checkpoint formats, against Megatron-Core 0.16.1's own MoE GPTModel
(SharedExpertMLP: ``mlp.shared_experts.linear_fc1``/``linear_fc2``, its ``gate_weight``):
its args (Megatron-LM's fields), the legacy files (--ckpt-format torch) that Megatron-Core
loads strictly at tp1 and tp2 with megart's logits, and Megatron-Core's own files read by
megart with its logits; the torch_dist store's keys, the store megart writes loaded by
Megatron-Core (tp1, pp2, tp2) and its own saves read by megart; megart train's saves in both
formats resumed on the curve holding what was saved; Megatron-Core's FP32Optimizer resuming
megart's legacy optimizer state (the gate in its param order). Bound 1e-6 on logits:
Megatron-Core's softmax over experts rounds to fp32."""

import os
from pathlib import Path

import pytest
import torch

import megatron_core_ckpt_workers as mckw
import megatron_core_workers as mcw
import megatron_dist_workers as mdw
import megatron_optim_workers as mow
import sweep_mcore_tp
import train_workers as tw
from megart.launcher import launch
from megart.models import GPTConfig
from megart.training.megatron_args import check_args, config_from_args, megatron_args
from megart.training.megatron_checkpoint import read_megatron
from test_megatron_dist_ckpt import _logits, _megart_checkpoint, _to_dist
from test_megatron_dist_moe import (
    LOGITS,
    _tokens,
    assert_keys_are,
    assert_megatron_core_holds,
    megatron_core_keys,
    scenario_runs,
)

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's torch_dist strategy needs it

# --ffn-hidden-size given, as Megatron-LM's args record it (4 h where not given).
BASE = dict(vocab_size=100, seq_length=8, hidden_size=16, num_layers=4, num_attention_heads=4,
            ffn_hidden_size=64, bias=False, num_experts=3, moe_ffn_hidden_size=24)  # fmt: skip
MODELS = {
    # Every layer MoE (one key per part in torch_dist), SwiGLU shared experts with the gate,
    # Llama-style around them.
    "swiglu-gated-every-layer": dict(activation="swiglu", normalization="rmsnorm",
                                     position_embedding="rotary", num_query_groups=2,
                                     untie_embeddings_and_output_weights=True,
                                     moe_shared_expert_intermediate_size=32,
                                     moe_shared_expert_gate=True),
    # A 0/1 pattern (each layer its own key), GeLU shared experts without the gate.
    "gelu-ungated-pattern": dict(moe_layer_freq=(1, 0, 1, 1),
                                 moe_shared_expert_intermediate_size=40),
    # Every second layer, SwiGLU, gated, top-1 pre-softmax.
    "swiglu-gated-freq2": dict(activation="swiglu", moe_layer_freq=2, moe_router_topk=1,
                               moe_router_pre_softmax=True,
                               moe_shared_expert_intermediate_size=16,
                               moe_shared_expert_gate=True),
}  # fmt: skip


def _cfg(name: str) -> GPTConfig:
    return GPTConfig(**BASE, **MODELS[name])


def test_args_hold_megatron_lms_shared_expert_fields_and_read_back():
    for name in MODELS:
        cfg = _cfg(name)
        a = vars(megatron_args(cfg, 3))
        assert a["moe_shared_expert_intermediate_size"] == cfg.moe_shared_expert_intermediate_size
        assert a["moe_shared_expert_gate"] == cfg.moe_shared_expert_gate
        assert config_from_args(a) == cfg
        check_args(a, "ckpt")  # taken (once refused by name)
    older = vars(megatron_args(_cfg("gelu-ungated-pattern"), 3))
    del older["moe_shared_expert_gate"]  # args from before Megatron had the gate: none
    assert not config_from_args(older).moe_shared_expert_gate


@pytest.mark.parametrize("name", list(MODELS))
def test_megatron_core_loads_megarts_legacy_files_with_its_logits(tmp_path, name):
    """convert-checkpoint --to megatron (torch): Megatron-Core's GPTModel of the files' args
    loads them strictly and computes megart's logits; converted back, the weights and config
    are megart's exactly."""
    _megart_checkpoint(_cfg(name), tmp_path / "megart")
    r = launch(mckw.legacy_checkpoint_roundtrip, 1, str(tmp_path / "megart"), str(tmp_path),
               timeout=300)[0]  # fmt: skip
    assert r["logits"] < LOGITS and r["same_weights"] and r["same_config"]


def _failed(e: Exception, what: str) -> str:
    return f"ERROR {type(e).__name__}: {e} {what}"


@pytest.mark.parametrize("name", ["swiglu-gated-every-layer", "gelu-ungated-pattern"])
def test_megatron_core_loads_tp2_legacy_files_with_megarts_logits(name):
    """Each of two tensor-parallel ranks' files (the shared experts' linear_fc1 rows, SwiGLU's
    [gate_r; up_r], and linear_fc2 columns split as a dense MLP's; the gate whole in both)
    loaded strictly by Megatron-Core's tp2 GPTModel: megart's logits; the ranks' files swapped,
    not."""
    kw = {**BASE, **MODELS[name]}
    verdict = sweep_mcore_tp.check(kw, launch, _failed, LOGITS)
    assert verdict.startswith("OK"), verdict
    if name == "swiglu-gated-every-layer":
        swapped = sweep_mcore_tp.check(kw, launch, _failed, LOGITS, swap_ranks=True)
        assert swapped.startswith("MISMATCH"), swapped


def save_legacy(kw: dict, out_dir: str, tokens: torch.Tensor) -> torch.Tensor | None:
    """On each of the launched tensor-parallel ranks: Megatron-Core's GPTModel of ``kw``, its
    own initial weights with noise (mdw.save_megatron's), saved as Megatron-LM's legacy saver
    lays out a rank's file (args, checkpoint_version, iteration, the module's state dict);
    its logits of ``tokens`` (gathered over the vocabulary shards)."""
    from megatron.core import parallel_state

    tp, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tp, 1)
    mcw.on_cpu_only()
    cfg = GPTConfig(**kw)
    model = mcw.megatron_model(cfg, tp)
    with torch.no_grad():  # the same noise on every rank for a replicated tensor
        for i, (_, p) in enumerate(model.named_parameters()):
            g = torch.Generator().manual_seed(1000 + i)
            p.add_(torch.rand(p.shape, generator=g, dtype=p.dtype) * 0.1)
    state = {"args": megatron_args(cfg, 3, tp, 1), "checkpoint_version": 3.0, "iteration": 3,
             "model": model.state_dict()}  # fmt: skip
    path = Path(out_dir, "iter_0000003", f"mp_rank_{rank:02d}", "model_optim_rng.pt")
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    if rank == 0:
        Path(out_dir, "latest_checkpointed_iteration.txt").write_text("3")
    logits = mdw.stage_logits(model.eval(), tokens, tp, 1)
    torch.distributed.destroy_process_group()
    return logits


@pytest.mark.parametrize("name,tp", [("swiglu-gated-every-layer", 2), ("gelu-ungated-pattern", 1),
                                     ("swiglu-gated-freq2", 2)])  # fmt: skip
def test_megart_reads_megatron_cores_legacy_files_with_its_logits(tmp_path, name, tp):
    cfg = _cfg(name)
    theirs = launch(save_legacy, tp, {**BASE, **MODELS[name]}, str(tmp_path), _tokens(cfg),
                    timeout=300)[0]  # fmt: skip
    read_cfg, model, iteration = read_megatron(tmp_path)
    assert iteration == 3 and read_cfg == cfg
    assert any(k.endswith("mlp.shared_experts.linear_fc1.weight") for k in model)
    got = mdw.megart_logits(read_cfg, model, _tokens(cfg))
    assert got.abs().max().item() > 0.1
    assert (got - theirs[..., : cfg.vocab_size]).abs().max().item() < LOGITS


def test_megarts_torch_dist_keys_are_megatron_cores():
    """The shared experts keyed as a dense MLP is under ``mlp.shared_experts.``, the gate's
    ``gate_weight`` beside them, their linear layers' extra states too."""
    cfgs = [_cfg(name) for name in MODELS]
    theirs = launch(megatron_core_keys, 1, cfgs, timeout=300)[0]
    for name, cfg, their in zip(MODELS, cfgs, theirs, strict=True):
        assert_keys_are(their, cfg, name)
    assert theirs[0]["shapes"]["decoder.layers.mlp.shared_experts.gate_weight"] == (4, 1, 16)
    assert theirs[1]["shapes"]["decoder.layers.2.mlp.shared_experts.linear_fc1.weight"] == (
        40, 16)  # fmt: skip


@pytest.mark.parametrize("name,tp,pp", [("swiglu-gated-every-layer", 1, 2),
                                        ("gelu-ungated-pattern", 2, 1),
                                        ("swiglu-gated-freq2", 2, 1)])  # fmt: skip
def test_megatron_core_loads_megarts_torch_dist_store_with_its_logits(tmp_path, name, tp, pp):
    cfg = _cfg(name)
    weights = _megart_checkpoint(cfg, tmp_path / "megart")
    _to_dist(tmp_path / "megart", tmp_path / "dist")
    want = _logits(cfg, weights)
    results = launch(mdw.load_and_run, tp * pp, str(tmp_path / "dist"), _tokens(cfg), tp, pp,
                     timeout=300)  # fmt: skip
    got = [r for r in results if r is not None]
    assert want.abs().max().item() > 0.1
    assert max((g[..., : cfg.vocab_size] - want).abs().max().item() for g in got) < LOGITS


@pytest.mark.parametrize("name,tp,pp", [("swiglu-gated-every-layer", 2, 1),
                                        ("gelu-ungated-pattern", 1, 2)])  # fmt: skip
def test_megart_reads_megatron_cores_torch_dist_saves_with_its_logits(tmp_path, name, tp, pp):
    cfg = _cfg(name)
    results = launch(mdw.save_megatron, tp * pp, {**BASE, **MODELS[name]},
                     str(tmp_path / "dist"), tp, pp, _tokens(cfg), timeout=300)  # fmt: skip
    theirs = next(r["logits"] for r in results if r["logits"] is not None)
    read_cfg, model, iteration = read_megatron(tmp_path / "dist")
    assert iteration == 3 and read_cfg == cfg
    got = mdw.megart_logits(cfg, model, _tokens(cfg))
    assert got.abs().max().item() > 0.1
    assert (got - theirs[..., : cfg.vocab_size]).abs().max().item() < LOGITS


# megart train's flags (TrainConfig's names) on its tiny GPT: gated SwiGLU shared experts, the
# auxiliary losses on.
SHARED = dict(num_experts=4, moe_ffn_hidden_size=48, moe_aux_loss_coeff=0.01,
              moe_z_loss_coeff=0.001, disable_bias_linear=True, swiglu=True,
              moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True)  # fmt: skip
TP2 = dict(tensor_model_parallel_size=2, sequence_parallel=True)
REL = dict(rel=5e-6, abs=0)  # a layout change reorders sums (test_megatron_dist_moe's REL)
SCENARIOS = {  # name: (saving ranks, flags), (resuming ranks, flags), tolerance
    "torch-tp2-to-tp1": ((2, dict(SHARED, **TP2, ckpt_format="torch")), (1, SHARED), REL),
    "torch-pp2": ((2, dict(SHARED, ckpt_format="torch", pipeline_model_parallel_size=2)),
                  (2, dict(SHARED, pipeline_model_parallel_size=2)), tw.SAME_RUN),
    # Megatron's legacy distributed-optimizer files (the gate in its buffers' order).
    "torch-distopt-dp2-to-dp1": (
        (2, dict(SHARED, ckpt_format="torch", use_distributed_optimizer=True)),
        (1, dict(SHARED, use_distributed_optimizer=True)), REL),
    "torch_dist-distopt-dp2-to-dp1": (
        (2, dict(SHARED, ckpt_format="torch_dist", use_distributed_optimizer=True)),
        (1, dict(SHARED, use_distributed_optimizer=True)), REL),
    "torch_dist-tp2-to-tp2": ((2, dict(SHARED, **TP2, ckpt_format="torch_dist")),
                              (2, dict(SHARED, **TP2)), tw.SAME_RUN),
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return scenario_runs(SCENARIOS, tmp_path_factory)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_train_saves_resume_on_the_curve_holding_exactly_what_was_saved(runs, name):
    straight, _, trained, resumed = runs[name]
    tw.assert_resumed_on_curve(straight, resumed, **SCENARIOS[name][2])
    tw.assert_holds(trained, resumed)


def test_megatron_core_loads_megarts_tp2_torch_dist_store_and_holds_its_state(runs):
    """Megatron-Core's tp2 MoE GPTModel and FP32Optimizer load megart train's store: each
    piece it holds (the shared experts' split, the gate whole on both ranks) equals megart's
    weights and Adam moments bitwise."""
    import megatron_dist_save_workers as w

    name = "torch_dist-tp2-to-tp2"
    _, store, trained, _ = runs[name]
    cfg = tw.tiny(**SCENARIOS[name][0][1]).gpt_config()
    results = launch(w.megatron_loads, 2, str(store), 2, 1, SCENARIOS[name][0][1], timeout=300)
    seen = assert_megatron_core_holds(results, trained, cfg, 2)
    assert "decoder.layers.mlp.shared_experts.gate_weight" in seen


def test_megatron_core_holds_megarts_legacy_distributed_optimizer_state(tmp_path):
    """Megatron-Core's DistributedDataParallel and DistributedOptimizer (dp2) load megart's
    distrib_optim.pt: the pieces they hold tile every parameter, the gate's included, each
    piece's main copy and moments those of megart's own checkpoint of the run."""
    import megatron_distopt_workers as mdo
    from test_megatron_distrib_optim import _pieces

    kw = dict(SHARED, train_iters=4, use_distributed_optimizer=True)
    ref, ours = str(tmp_path / "ref"), str(tmp_path / "megart")
    launch(tw.train_kw, 2, dict(kw, save=ref, save_interval=2), timeout=300)
    launch(tw.train_kw, 2, dict(kw, save=ours, save_interval=2, exit_interval=2,
                                ckpt_format="torch"), timeout=300)  # fmt: skip
    megatron = launch(mdo.load_and_write, 2, kw, ours, ref, None, timeout=300)
    pieces = _pieces(dict(megatron=megatron))
    for key, held in pieces.items():  # the pieces tile every parameter
        held.sort()
        assert held[0][0] == 0 and held[-1][1] == held[-1][2], (key, held)
        assert all(a[1] == b[0] for a, b in zip(held, held[1:], strict=False)), (key, held)
    assert any("shared_experts.gate_weight" in str(key) for key in pieces), list(pieces)


def test_megatron_core_resumes_megarts_legacy_optimizer_state(tmp_path):
    """Megatron-Core's model and FP32Optimizer (its own param groups and order: the shared
    experts' gate_weight after the routed experts, before the shared linear layers) load
    megart train's files of iteration 1 and take iterations 2 and 3 as megart did."""
    kw = dict(SHARED, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None, train_iters=5)
    ours = str(tmp_path / "megart")
    straight = launch(tw.train_kw, 1, {**kw, "save": ours, "save_interval": 1,
                                       "ckpt_format": "torch"}, timeout=300)[0]  # fmt: skip
    (rank,) = launch(mow.resume_and_write, 1, kw, ours, str(tmp_path / "megatron"), timeout=300)
    assert rank["weights_diff"] < 1e-6  # its step from megart's state is megart's step
    assert rank["losses"] == pytest.approx([h["loss"] for h in straight[1:3]], **tw.SAME_RUN)
