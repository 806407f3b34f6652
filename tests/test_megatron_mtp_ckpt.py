"""Multi-token prediction (megart.models.mtp) in Megatron-LM's checkpoints, against
Megatron-Core 0.16.1's own GPTModel with an MTP block spec (local spec, float64, CPU;
megatron_mtp_ckpt_workers): its flags in the args both ways (and --use-checkpoint-args), the
legacy files' names, order and tensor-parallel slices (eh_proj split on its rows) and
torch_dist's keys, shard axes and extra states as Megatron-Core's model gives them,
Megatron-Core loading megart train's files and stores (megart's logits, main loss and depth
losses), megart reading what Megatron-Core saves, Megatron-Core's optimizer taking megart's
optimizer state and stepping on, and megart train resuming its own Megatron-format MTP
checkpoints on the one-process curve of the main and depth losses at tp1 and tp2, with
either optimizer (Megatron-Core's distributed optimizer on them: test_megatron_mtp_distopt).
Megatron-Core computes its losses in fp32: they agree to ~5e-7 (measured) where the logits
agree to ~3e-16."""

import dataclasses

import pytest
import torch

import megatron_core_workers as mcw
import megatron_mla_ckpt_workers as mmw
import megatron_mtp_ckpt_workers as mtw
import megatron_optim_workers as mow
import mtp_workers as mw
import train_workers as tw
from megart.cli.main import main
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.models.megatron_names import to_megatron
from megart.training.megatron_args import config_from_args, megatron_args
from megart.training.megatron_checkpoint import read_megatron
from megart.training.megatron_dist import extra_states
from megart.training.megatron_dist_keys import sharded_keys
from megart.training.megatron_layout import split, tp_dim
from megart.training.megatron_optimizer import in_megatron_order

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's torch_dist writer needs it

BASE = dict(vocab_size=128, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
            mtp_num_layers=2, position_embedding="rotary")  # fmt: skip
MODELS = {
    "gpt2-tied": BASE,
    "llama-untied": dict(
        BASE,
        normalization="rmsnorm",
        activation="swiglu",
        ffn_hidden_size=64,
        bias=False,
        untie_embeddings_and_output_weights=True,
        num_query_groups=2,
    ),  # fmt: skip
}
TRAIN = dict(position_embedding_type="rope", mtp_num_layers=2, train_iters=4)
UNTIED = dict(TRAIN, untie_embeddings_and_output_weights=True)
NAMES = ("loss", "mtp_1 loss", "mtp_2 loss")
LOSS = 2e-6  # Megatron-Core's fp32 losses against megart's float64 (measured: up to 6.1e-7)


def _explicit(cfg: GPTConfig) -> GPTConfig:
    """``cfg`` as Megatron's args read back: the MLP's width given (its 4h written out), and
    no bias-GeLU fusion (megart train's kernel choice, which those args do not record)."""
    return dataclasses.replace(cfg, ffn_hidden_size=cfg.ffn_size, bias_gelu_fusion=False)


def _batch(cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def test_args_hold_megatron_lms_mtp_flags_and_read_back():
    cfg = GPTConfig(**dict(BASE, mtp_loss_scaling_factor=0.3))
    a = vars(megatron_args(cfg, 3))
    assert (a["mtp_num_layers"], a["mtp_loss_scaling_factor"]) == (2, 0.3)
    assert config_from_args(a) == _explicit(cfg)
    plain = GPTConfig(**dict(BASE, mtp_num_layers=None))
    b = vars(megatron_args(plain, 0))
    assert (b["mtp_num_layers"], b["mtp_loss_scaling_factor"]) == (None, 0.1)
    older = {k: v for k, v in b.items() if not k.startswith("mtp_")}  # args before MTP
    assert config_from_args(older) == config_from_args(b) == _explicit(plain)
    # Megatron-LM's default factor where args lack it.
    no_factor = {k: v for k, v in a.items() if k != "mtp_loss_scaling_factor"}
    assert config_from_args(no_factor).mtp_loss_scaling_factor == 0.1


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(mtp_use_repeated_layer=True), "--mtp-use-repeated-layer: megart's depths"),
        (dict(mtp_hsm=True), "--mtp-hsm"),
        (dict(pipeline_model_parallel_size=2), "on 2 pipeline stages"),
        (
            dict(num_experts=2, use_distributed_optimizer=True),
            r"experts \(--num-experts 2\) with --use-distributed-optimizer",
        ),
    ],
)
def test_megatron_args_megart_does_not_read_its_depths_of_are_refused(change, words):
    a = vars(megatron_args(GPTConfig(**BASE), 3))
    with pytest.raises(ConfigError, match=words):
        config_from_args({**a, **change})


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def layout(request):
    tp = request.param
    return tp, {name: launch(mmw.megatron_layout, tp, kw, timeout=300)
                for name, kw in MODELS.items()}  # fmt: skip


@pytest.mark.parametrize("name", list(MODELS))
def test_legacy_files_hold_megatron_cores_names_order_and_slices(layout, name):
    """Each tensor-parallel rank's legacy file holds the names, in order (its optimizer's
    parameter order: the depths after the decoder's final norm, before the output layer), and
    the shapes of Megatron-Core's own MTP model on that rank: eh_proj [h, 2h] split on its
    rows, with an extra state; the depths' norms whole."""
    tp, ranks = layout
    cfg = GPTConfig(**MODELS[name])
    whole = to_megatron(GPT(cfg).chunk.state_dict(), cfg)
    mcw.pad_vocab(whole, cfg, tp)
    files = split(whole, cfg, tp, 1)
    for t, theirs in enumerate(ranks[name]):
        ours = in_megatron_order(files[t, 0][0])
        assert list(ours) == list(theirs["state"])
        shapes = {k: None if v is None else tuple(v.shape) for k, v in ours.items()}
        assert shapes == theirs["state"]
        assert shapes["mtp.layers.1.eh_proj.weight"] == (32 // tp, 64)


@pytest.mark.parametrize("name", list(MODELS))
def test_torch_dist_keys_and_shard_axes_are_megatron_cores(layout, name):
    """The store's keys and global shapes and each tensor's tensor-parallel axis are those of
    Megatron-Core's sharded_state_dict: each depth keyed apart under its module names, its
    layer's norms under the fused names, eh_proj cut on its rows; an extra state each."""
    tp, ranks = layout
    cfg = GPTConfig(**MODELS[name])
    whole = to_megatron(GPT(cfg).chunk.state_dict(), cfg)
    mcw.pad_vocab(whole, cfg, tp)
    stored = {k: tuple(v.shape) for k, v in sharded_keys(whole, cfg).items()}
    theirs = ranks[name][0]["sharded"]
    assert stored == {key: shape for key, shape, _, _ in theirs.values()}
    assert "mtp.layers.1.transformer_layer.mlp.linear_fc1.layer_norm_weight" in stored
    for per_layer, (_, _, pieces, halves) in theirs.items():
        dim = tp_dim(per_layer)
        want = [tp if d == dim else 1 for d in range(len(pieces))]
        if halves:  # SwiGLU's gate and up pieces on the rows
            want[0] *= 2
        assert list(pieces) == want, per_layer
    assert theirs["mtp.layers.0.eh_proj.weight"][2] == (tp, 1)
    untied = cfg.untie_embeddings_and_output_weights
    objects = set(extra_states(range(cfg.num_layers), cfg, untied, depths=True))
    # megart writes the untied output layer's too, which Megatron-Core's GPTModel drops from
    # its sharded state dict (unasked for, it is left alone by Megatron-LM's load).
    objects.discard("output_layer._extra_state/shard_0_1")
    assert objects == ranks[name][0]["objects"]


@pytest.fixture(scope="module")
def one_process():
    return mw.one_process_histories({"tied": TRAIN, "untied": UNTIED})


SAVES = {  # name: (processes, flags, format)
    "torch-tp1": (1, {}, "torch"),
    "torch-tp2": (2, dict(tensor_model_parallel_size=2), "torch"),
    "torch_dist-tp1": (1, {}, "torch_dist"),
    "torch_dist-tp2": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), "torch_dist"),
    "torch-dp2-distopt": (2, dict(use_distributed_optimizer=True), "torch"),
    "torch_dist-tp2-distopt": (
        4,
        dict(tensor_model_parallel_size=2, use_distributed_optimizer=True),
        "torch_dist",
    ),  # fmt: skip
    # Several pipeline stages: torch_dist with an untied output layer (the last stage's
    # embedding copy a replica of the first stage's).
    "torch_dist-tp2-pp2-untied": (
        4,
        dict(UNTIED, tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
        "torch_dist",
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """Per case: megart train's Megatron-format checkpoint after 2 of 4 iterations."""
    out = {}
    for name, (nproc, flags, fmt) in SAVES.items():
        ckpt = tmp_path_factory.mktemp(name) / "ckpt"
        kw = dict(TRAIN, **flags, save=str(ckpt), exit_interval=2, ckpt_format=fmt)
        launch(tw.train_kw, nproc, kw, timeout=300)
        out[name] = ckpt
    return out


@pytest.mark.parametrize("name", list(SAVES))
def test_megart_resumes_its_megatron_format_mtp_checkpoints_on_the_curve(saves, one_process, name):
    """The main loss and each depth's, after the load, on the uninterrupted run's."""
    nproc, flags, _ = SAVES[name]
    want = one_process["untied" if "untie_embeddings_and_output_weights" in flags else "tied"]
    for rank in launch(tw.train_kw, nproc, dict(TRAIN, **flags, load=str(saves[name])),
                       timeout=300):  # fmt: skip
        if rank:  # a last-stage rank's (the others log none)
            assert mw.curve(rank, NAMES) == pytest.approx(mw.curve(want[2:], NAMES), **tw.SAME_RUN)


def _assert_same(got: dict, want: dict, vocab: int) -> None:
    """Megatron-Core's figures (megatron_run's) against megart's (megart_run's)."""
    assert want["logits"].abs().max() > 0.1 and all(3 < d < 8 for d in want["depths"])
    assert (got["logits"][..., :vocab] - want["logits"]).abs().max().item() < 1e-10
    assert (got["loss"] - want["loss"]).abs().max().item() < LOSS
    assert (got["depths"] - want["depths"]).abs().max().item() < LOSS


@pytest.mark.parametrize(
    "name",
    ["torch-tp1", "torch-tp2", "torch_dist-tp1", "torch_dist-tp2", "torch_dist-tp2-pp2-untied"],
)
def test_megatron_core_loads_megarts_files_with_its_logits_and_depth_losses(saves, name):
    """Each of Megatron-Core's tensor-parallel ranks strictly loads its own legacy file, or its
    slices of the store as Megatron-LM's loader asks for them (strict about missing keys; at
    pp2 its last stage's embedding copy from the first stage's key), and computes megart's
    logits, main per-token loss and each depth's loss (the pipeline run by hand)."""
    nproc, flags, fmt = SAVES[name]
    cfg, model, _ = read_megatron(saves[name])
    tokens, labels = _batch(cfg)
    want = mtw.megart_run(cfg, model, tokens, labels)
    if fmt == "torch":
        results = launch(mtw.legacy_run, nproc, str(saves[name]), tokens, labels, timeout=300)
    else:
        pp = flags.get("pipeline_model_parallel_size", 1)
        results = launch(mtw.dist_run, nproc, str(saves[name]), tokens, labels, pp, timeout=300)
    got = [r for r in results if r is not None]
    assert len(got) == nproc // flags.get("pipeline_model_parallel_size", 1)
    for result in got:
        _assert_same(result, want, cfg.vocab_size)


@pytest.mark.parametrize("saved,run", [(1, 2), (2, 1)])
def test_megart_reads_megatron_cores_mtp_store(tmp_path, saved, run):
    """Megatron-Core's MTP GPTModel saves its own (drawn) weights on ``saved`` tensor-parallel
    ranks through dist_checkpointing; megart's reader gives a GPT computing its logits, main
    and depth losses, and megart train at tensor-parallel size ``run`` loads it holding
    exactly the store's tensors."""
    from megart.models.megatron_names import from_megatron

    cfg = tw.tiny(**TRAIN).gpt_config()
    tokens, labels = _batch(cfg)
    store = tmp_path / "dist"
    theirs = launch(mtw.save_megatron, saved, dataclasses.asdict(cfg), str(store), saved,
                    tokens, labels, timeout=300)[0]  # fmt: skip
    read_cfg, model, _ = read_megatron(store)
    assert read_cfg == _explicit(cfg)
    _assert_same(theirs, mtw.megart_run(cfg, model, tokens, labels), cfg.vocab_size)
    want = {"chunk." + k: v for k, v in from_megatron(model, cfg).items()}
    assert any(k.startswith("chunk.mtp.layers.1.") for k in want)
    kw = dict(TRAIN, load=str(store), train_iters=1, tensor_model_parallel_size=run)
    seen = set()
    for rank in launch(tw.train_holding, run, kw, timeout=300):
        for name, value in rank["loaded"]["weights"].items():
            assert torch.equal(value, want[name].to(value.dtype)), name
            seen.add(name)
    assert seen == set(want)


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_cores_optimizer_takes_megarts_mtp_optimizer_state(tmp_path, tp):
    """--ckpt-format torch: Megatron-Core's own param groups over its MTP model and its
    FP32Optimizer load megart's files (the depths' parameters in its order) and take
    iterations 2 and 3 as megart does (main loss, weights after a step, the depths' losses in
    its backward); megart resumes what Megatron-Core then writes on the curve."""
    kw = dict(TRAIN, train_iters=5, tensor_model_parallel_size=tp)
    ours, theirs = str(tmp_path / "megart"), str(tmp_path / "megatron")
    straight = launch(tw.train_kw, tp, dict(kw, save=ours, save_interval=1, ckpt_format="torch"),
                      timeout=300)[0]  # fmt: skip
    for rank in launch(mow.resume_and_write, tp, kw, ours, theirs, timeout=300):
        assert rank["weights_diff"] < 1e-6
        assert rank["losses"] == pytest.approx([h["loss"] for h in straight[1:3]], **tw.SAME_RUN)
    resumed = launch(tw.train_kw, tp, dict(kw, load=theirs), timeout=300)[0]
    assert [h["iteration"] for h in resumed] == [4, 5]
    assert mw.curve(resumed, NAMES) == pytest.approx(mw.curve(straight[3:], NAMES), **tw.SAME_RUN)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_convert_checkpoint_writes_megarts_mtp_run_for_megatron_core(tmp_path, fmt):
    """convert-checkpoint of megart train's own MTP checkpoint to Megatron-LM's format at
    tensor-parallel size 2: Megatron-Core's two ranks load it and compute the checkpoint's
    logits and losses; converted back, megart's weights are unchanged."""
    import megatron_core_ckpt_workers as mckw

    launch(tw.train_kw, 1, dict(TRAIN, save=str(tmp_path / "megart"), train_iters=1),
           timeout=300)  # fmt: skip
    out = tmp_path / "megatron"
    assert main(["convert-checkpoint", "--from", "megart", "--to", "megatron", "--ckpt-format",
                 fmt, "--target-tensor-parallel-size", "2", "--load", str(tmp_path / "megart"),
                 "--save", str(out)]) == 0  # fmt: skip
    ours = launch(mckw.checkpoint_gpt, 1, str(tmp_path / "megart"), timeout=300)[0][1]
    cfg = tw.tiny(**TRAIN).gpt_config()
    tokens, labels = _batch(cfg)
    want = mtw.megart_run(cfg, to_megatron(ours, cfg), tokens, labels)
    run = mtw.legacy_run if fmt == "torch" else mtw.dist_run
    for got in launch(run, 2, str(out), tokens, labels, timeout=300):
        _assert_same(got, want, cfg.vocab_size)
    assert main(["convert-checkpoint", "--from", "megatron", "--to", "megart", "--load",
                 str(out), "--save", str(tmp_path / "back")]) == 0  # fmt: skip
    back = launch(mckw.checkpoint_gpt, 1, str(tmp_path / "back"), timeout=300)[0][1]
    assert set(back) == set(ours) and any(k.startswith("mtp.layers.1.") for k in ours)
    assert all(torch.equal(back[k], ours[k]) for k in ours)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_use_checkpoint_args_takes_the_depths(saves, tmp_path, fmt):
    """From Megatron's args alone (megart's record stripped): --mtp-num-layers forced over the
    command line's, as Megatron-LM's loader forces it."""
    import shutil

    from test_checkpoint_args import USE, flags_config, strip_megart_record

    copy = tmp_path / "stripped"
    shutil.copytree(saves[f"{fmt}-tp1"], copy)
    strip_megart_record(copy)
    got = flags_config(["--load", str(copy), *USE, "--mtp-num-layers", "1"])
    assert got.mtp_num_layers == 2
    assert got.gpt_config() == dataclasses.replace(
        tw.tiny(**TRAIN).gpt_config(), ffn_hidden_size=128
    )


def test_pipeline_stages_and_experts_with_depths_are_refused_in_megatrons_formats(tmp_path, capsys):
    # MoE depths on one stage with Megatron-Core's plain optimizer: test_megatron_mtp_moe_ckpt.
    from megart.training.config_checks import check_config

    pp2 = dict(pipeline_model_parallel_size=2)
    for kw, words in ((dict(pp2, ckpt_format="torch_dist"), r"here: tied embeddings"),
                      (dict(pp2, untie_embeddings_and_output_weights=True, ckpt_format="torch"),
                       r"here: torch\)"),
                      (dict(pp2, untie_embeddings_and_output_weights=True,
                            ckpt_format="torch_dist", use_distributed_optimizer=True),
                       "here: --use-distributed-optimizer"),
                      (dict(num_experts=2, disable_bias_linear=True, ckpt_format="torch_dist",
                            use_distributed_optimizer=True),
                       r"experts \(--num-experts 2\) with --use-distributed-optimizer"),
                      (dict(pp2, num_experts=2, disable_bias_linear=True, ckpt_format="torch_dist",
                            untie_embeddings_and_output_weights=True),
                       r"experts \(--num-experts 2\) on several pipeline stages")):  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            check_config(tw.tiny(**TRAIN, **kw), 4)
    check_config(tw.tiny(**UNTIED, **pp2, ckpt_format="torch_dist"), 2)
    launch(tw.train_kw, 1, dict(TRAIN, save=str(tmp_path / "megart"), train_iters=1),
           timeout=300)  # fmt: skip
    assert main(["convert-checkpoint", "--from", "megart", "--to", "megatron",
                 "--target-pipeline-parallel-size", "2", "--load", str(tmp_path / "megart"),
                 "--save", str(tmp_path / "out")]) == 2  # fmt: skip
    assert "on 2 pipeline stages" in capsys.readouterr().err
