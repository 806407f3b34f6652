"""Multi-token prediction depths whose layer is an MoE layer (a depth takes the last decoder
layer's kind: models.mtp) in Megatron-LM's checkpoints, against Megatron-Core 0.16.1's GPTModel
with an MTP block spec over its MoE layer spec (local, float64, CPU; megatron_mtp_ckpt_workers):
Megatron-Core loading megart train's legacy files and torch_dist stores at ep1 and ep2 (the
depths' experts under ``mtp.layers.K.transformer_layer.mlp.experts``, split over the
expert-parallel ranks as a decoder layer's; the depth routers' expert biases) with megart's
logits and depth losses, megart reading Megatron-Core's own store, and megart resuming its own
files on the one-process curve."""

import dataclasses

import pytest
import torch

import megatron_mtp_ckpt_workers as mtw
import megatron_mtp_moe_workers as mmw
import mtp_workers as mw
import train_workers as tw
from megart.launcher import launch
from megart.models.megatron_names import EXPERT_BIAS
from megart.training.megatron_checkpoint import read_megatron

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's torch_dist writer needs it

MOE = dict(position_embedding_type="rope", mtp_num_layers=2, train_iters=4, num_experts=4,
           disable_bias_linear=True, swiglu=True, moe_router_topk=2, moe_aux_loss_coeff=0.01,
           moe_router_dtype="fp32")  # fmt: skip
# DeepSeek-V3's router: sigmoid scores and the expert bias, which the depths' routers update too.
BIAS = dict(MOE, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_dtype="fp64")  # fmt: skip
NAMES = ("loss", "mtp_1 loss", "mtp_2 loss")
LOSS = 2e-6  # Megatron-Core's fp32 losses against megart's float64 (measured: up to 5.2e-7)


def _batch(cfg):
    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    return data[:, :-1], data[:, 1:]


EP2 = dict(expert_model_parallel_size=2)
TP2 = dict(tensor_model_parallel_size=2, sequence_parallel=True)  # MoE at tp > 1 needs SP
SAVES = {  # name: (processes, flags, format)
    "torch-ep1": (1, MOE, "torch"),
    "torch_dist-ep1": (1, MOE, "torch_dist"),
    "torch-ep2-bias": (2, dict(BIAS, **EP2), "torch"),
    "torch_dist-ep2-bias": (2, dict(BIAS, **EP2), "torch_dist"),
    "torch-tp2": (2, dict(MOE, **TP2), "torch"),
    "torch_dist-tp2": (2, dict(MOE, **TP2), "torch_dist"),
}


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """Per case: megart train's Megatron-format checkpoint after 2 of 4 iterations."""
    out = {}
    for name, (nproc, flags, fmt) in SAVES.items():
        ckpt = tmp_path_factory.mktemp(name) / "ckpt"
        kw = dict(flags, save=str(ckpt), exit_interval=2, ckpt_format=fmt)
        launch(tw.train_kw, nproc, kw, timeout=300)
        out[name] = ckpt
    return out


def _assert_same(got: dict, want: dict, vocab: int, logits: float = 1e-10) -> None:
    """Megatron-Core's figures (megatron_run's) against megart's (megart_run's)."""
    assert want["logits"].abs().max() > 0.1 and all(3 < d < 8 for d in want["depths"])
    assert (got["logits"][..., :vocab] - want["logits"]).abs().max().item() < logits
    assert (got["loss"] - want["loss"]).abs().max().item() < LOSS
    assert (got["depths"] - want["depths"]).abs().max().item() < LOSS


@pytest.mark.parametrize("name", list(SAVES))
def test_megatron_core_loads_megarts_moe_depths(saves, name):
    """Megatron-Core's MTP GPTModel over its MoE layer spec strictly loads megart train's legacy
    file (its expert-parallel ranks' files merged as the reader merges them) or store, and
    computes megart's logits, main per-token loss and each depth's loss; with the expert bias
    the depth routers' biases (moved by two updates) are in the files."""
    nproc, flags, fmt = SAVES[name]
    cfg, model, _ = read_megatron(saves[name])
    assert any(".transformer_layer.mlp.experts.local_experts.3." in k for k in model)
    if "bias" in name:
        bias = model["mtp.layers.1.transformer_layer.mlp.router.expert_bias"]
        assert bias.abs().max() > 1e-4
    tokens, labels = _batch(cfg)
    want = mtw.megart_run(cfg, model, tokens, labels)
    run = mmw.tp_run if "tp2" in name else mmw.ep_run
    got = launch(run, nproc, str(saves[name]), fmt, tokens, labels, timeout=300)
    assert len(got) == nproc
    # Its MoE layers at tp2 round to fp32 somewhere on the way (as test_moe_ep_tp finds;
    # measured 1.5e-10 here), elsewhere float64 throughout (measured 2.8e-16).
    bound = 1e-8 if "tp2" in name else 1e-10
    for result in got:
        _assert_same(result, want, cfg.vocab_size, bound)
    if "bias" in name:  # each depth's bias is the row megart's trainer kept for that depth
        rows = _trainer_rows(saves["torch-ep2-bias"])
        for k in range(cfg.mtp_num_layers):
            loaded = got[0]["biases"][f"mtp.layers.{k}.transformer_layer.{EXPERT_BIAS}"]
            assert torch.equal(loaded, rows[cfg.num_layers + k])


def _trainer_rows(ckpt) -> torch.Tensor:
    """Every layer's expert bias as megart's trainer held it at the save (models.moe_router.
    expert_bias_rows, recorded in its legacy file apart from Megatron's keys): the same in the
    torch_dist run, whose training is the same."""
    from megart.training import checkpoint
    from megart.training.megatron_files import torch_load

    root = checkpoint.iteration_dir(ckpt, checkpoint.latest_iteration(ckpt))
    return torch_load(root / "mp_rank_00_000" / checkpoint.FILE)["megart"]["expert_bias"]


@pytest.fixture(scope="module")
def one_process():
    return mw.one_process_histories({"moe": MOE, "bias": BIAS})


@pytest.mark.parametrize("name", list(SAVES))
def test_megart_resumes_its_megatron_format_moe_depths_on_the_curve(saves, one_process, name):
    """The main loss and each depth's, after the load (at the saved expert-parallel size), on
    the uninterrupted one-process run's: the depths' experts and their routers' biases back."""
    nproc, flags, _ = SAVES[name]
    want = one_process["bias" if "bias" in name else "moe"]
    for rank in launch(tw.train_kw, nproc, dict(flags, load=str(saves[name])), timeout=300):
        assert mw.curve(rank, NAMES) == pytest.approx(mw.curve(want[2:], NAMES), **tw.SAME_RUN)


def test_megart_reads_megatron_cores_moe_depths_store(tmp_path):
    """Megatron-Core's MTP GPTModel with MoE depths saves its own (drawn) weights through
    dist_checkpointing; megart's reader gives a GPT computing its logits, main and depth
    losses, and megart train at ep2 loads it holding exactly the store's tensors."""
    from megart.models.megatron_names import from_megatron

    cfg = tw.tiny(**MOE).gpt_config()
    tokens, labels = _batch(cfg)
    store = tmp_path / "dist"
    theirs = launch(mtw.save_megatron, 1, dataclasses.asdict(cfg), str(store), 1, tokens,
                    labels, timeout=300)[0]  # fmt: skip
    _, model, _ = read_megatron(store)
    _assert_same(theirs, mtw.megart_run(cfg, model, tokens, labels), cfg.vocab_size)
    want = {"chunk." + k: v for k, v in from_megatron(model, cfg).items()}
    assert any(k.startswith("chunk.mtp.layers.1.transformer_layer.mlp.experts.3.") for k in want)
    kw = dict(MOE, load=str(store), train_iters=1, expert_model_parallel_size=2)
    seen = set()
    for rank in launch(tw.train_holding, 2, kw, timeout=300):
        for name, value in rank["loaded"]["weights"].items():
            assert torch.equal(value, want[name].to(value.dtype)), name
            seen.add(name)
    assert seen == set(want)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_convert_checkpoint_writes_moe_depths_for_megatron_core(tmp_path, fmt):
    """convert-checkpoint of megart train's own checkpoint (MoE depths, expert bias, trained at
    ep2) to Megatron-LM's format: Megatron-Core loads it with the checkpoint's logits and
    losses and each depth router's bias as megart's trainer kept it; converted back, megart's
    weights and biases are unchanged."""
    import megatron_core_ckpt_workers as mckw
    from megart.cli.main import main
    from megart.models.megatron_names import to_megatron
    from megart.training import checkpoint
    from megart.training.megatron_expert_bias import added
    from megart.training.shards import read_shards

    ours_dir, out, back_dir = tmp_path / "megart", tmp_path / "megatron", tmp_path / "back"
    launch(tw.train_kw, 2, dict(BIAS, **EP2, save=str(ours_dir), train_iters=2), timeout=300)
    assert main(["convert-checkpoint", "--from", "megart", "--to", "megatron", "--ckpt-format",
                 fmt, "--load", str(ours_dir), "--save", str(out)]) == 0  # fmt: skip
    ours = launch(mckw.checkpoint_gpt, 1, str(ours_dir), timeout=300)[0][1]

    def rows_of(directory):
        root = checkpoint.iteration_dir(directory, checkpoint.latest_iteration(directory))
        return read_shards(root)[0, 0]["expert_bias"]

    rows = rows_of(ours_dir)
    cfg = tw.tiny(**BIAS).gpt_config()
    assert rows[cfg.num_layers :].abs().max() > 1e-4  # the depths' routers moved
    tokens, labels = _batch(cfg)
    megatron = to_megatron(ours, cfg)
    added(megatron, rows, cfg)  # every router's bias (the decoder's and the depths')
    want = mtw.megart_run(cfg, megatron, tokens, labels)
    (got,) = launch(mmw.ep_run, 1, str(out), fmt, tokens, labels, timeout=300)
    _assert_same(got, want, cfg.vocab_size)
    for k in range(cfg.mtp_num_layers):
        loaded = got["biases"][f"mtp.layers.{k}.transformer_layer.{EXPERT_BIAS}"]
        assert torch.equal(loaded, rows[cfg.num_layers + k])
    assert main(["convert-checkpoint", "--from", "megatron", "--to", "megart", "--load",
                 str(out), "--save", str(back_dir)]) == 0  # fmt: skip
    back = launch(mckw.checkpoint_gpt, 1, str(back_dir), timeout=300)[0][1]
    assert set(back) == set(ours) and all(torch.equal(back[k], ours[k]) for k in ours)
    assert torch.equal(rows_of(back_dir), rows)
