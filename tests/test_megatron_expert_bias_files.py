"""Megatron-LM's own legacy files (--ckpt-format torch, no megart record) of a model with the
routers' expert bias (--moe-router-enable-expert-bias): Megatron-Core 0.16.1's MoE GPTModel's
state dict, its biases drawn nonzero, written as Megatron-LM writes each pipeline rank's file
(its stage's layers, numbered from 0 in each chunk). megart train --load of pp1, pp2 and
interleaved files into pp1 and pp2 holds exactly those biases (under another layout gathered
from every stage's file) and gives Megatron-Core's logits; convert-checkpoint carries them both
ways. Reading pp rank 1's biases under their local layer numbers is caught. megart's one
definition of the bias's key (models.megatron_names) is Megatron-Core's, and with it
megatron_optimizer.is_parameter picks out exactly Megatron-Core's parameters."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

import megatron_core_workers as mcw
import train_workers as tw
from megart.launcher import launch
from megart.models import GPT
from megart.models import moe_router as mr
from megart.models.megatron_names import (
    expert_bias_key,
    expert_bias_layer,
    from_megatron,
    to_megatron,
)
from megart.training import megatron_file_read
from megart.training.megatron_optimizer import is_parameter
from test_moe_router_balance import TRAIN

# The tiny run's model with the expert bias (sigmoid scores), every layer MoE but layer 1.
KW = dict(TRAIN, train_iters=1, moe_layer_freq="[1,0,1,1]")
SAVED = 7  # the files' iteration


def _write_files(directory: str, pp: int, vpp: int) -> dict:
    """Megatron-Core's GPTModel of KW (one process, weights noised, each router's expert bias
    drawn) in Megatron-LM's legacy files for ``pp`` ranks x ``vpp`` chunks (weights alone, as
    --no-save-optim writes them; args as megart records Megatron-LM's, no megart record); its
    biases [layers, E] (zero rows for the dense layer) and its float64 logits of TOKENS."""
    from megart.training import checkpoint
    from megart.training.megatron_args import megatron_args
    from megart.training.megatron_files import rank_state
    from megart.training.megatron_layout import split

    cfg = tw.tiny(**KW).gpt_config()
    theirs = mcw.drawn(mcw.megatron_model(cfg))
    g = torch.Generator().manual_seed(13)
    rows = torch.zeros(cfg.num_layers, cfg.num_experts)
    for i, layer in enumerate(theirs.decoder.layers):
        if hasattr(layer.mlp, "router"):
            rows[i] = torch.randn(cfg.num_experts, generator=g)
            layer.mlp.router.expert_bias.copy_(rows[i])
    state = theirs.state_dict()
    weights = {k: v.float() for k, v in state.items() if not k.endswith("_extra_state")}
    theirs.load_state_dict(weights, strict=False)  # the logits of the fp32 values written
    args = megatron_args(cfg, SAVED, 1, pp, vpp)
    root = checkpoint.iteration_dir(directory, SAVED)
    for (t, p), chunks in split(weights, cfg, 1, pp, vpp).items():
        path = root / checkpoint.rank_dir(t, p, pp) / checkpoint.FILE
        path.parent.mkdir(parents=True)
        torch.save(rank_state(args, SAVED, chunks), path)
    (Path(directory) / checkpoint.TRACKER).write_text(f"{SAVED}\n")
    return dict(bias=rows, logits=mcw.megatron_logits(theirs.eval(), TOKENS))


TOKENS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(5))


_FILE_ROWS = megatron_file_read.file_expert_bias


def _local_rows(chunks, layer_ids, cfg):
    """The mistake: each chunk's biases under their local layer numbers (pp rank 1's land
    on the first stage's layers)."""
    return _FILE_ROWS(chunks, [list(range(len(ids))) for ids in layer_ids], cfg)


def _loaded(directory: str, pp: int, mistake: bool) -> dict:
    """On each of ``pp`` ranks: megart train's Trainer of KW at pipeline size ``pp`` loading
    ``directory``; every layer's expert bias it holds, and (one rank) its float64 logits."""
    from megart.training.data import builtin_corpus
    from megart.training.trainer import Trainer

    patch = mock.patch.object(megatron_file_read, "file_expert_bias", _local_rows)
    with patch if mistake else mock.MagicMock():
        config = tw.tiny(**KW, load=directory, pipeline_model_parallel_size=pp)
        t = Trainer(config, tokens=builtin_corpus(1 << 16))
    cfg = t.model_config
    rows = mr.expert_bias_rows(t.chunks, cfg, t.grid.pp_group, t.device)
    logits = None
    if pp == 1:
        ours = GPT(cfg)
        ours.chunk.load_state_dict(t.chunks[0].state_dict(), strict=True)
        ours.double()
        mr.load_expert_bias([ours.chunk], rows)
        with torch.no_grad():
            logits = ours.eval()(TOKENS)
    return dict(bias=rows, logits=logits)


# name: (files' pipeline size, their chunks per rank, the loading run's pipeline size)
LOADS = {"pp1-into-pp1": (1, 1, 1), "pp2-into-pp2": (2, 1, 2), "pp2-into-pp1": (2, 1, 1),
         "pp1-into-pp2": (1, 1, 2), "pp2-vpp2-into-pp1": (2, 2, 1)}  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = {}
    for shape in sorted({(pp, vpp) for pp, vpp, _ in LOADS.values()}):
        d = str(tmp_path_factory.mktemp(f"megatron-pp{shape[0]}-vpp{shape[1]}"))
        out[shape] = d, launch(_write_files, 1, d, *shape, timeout=300)[0]
    return out


@pytest.mark.parametrize("name", list(LOADS))
def test_megart_loads_megatron_lms_files_with_their_expert_biases(files, name):
    pp, vpp, into = LOADS[name]
    directory, written = files[pp, vpp]
    assert (written["bias"] != 0).sum() == 3 * 4  # 3 MoE layers x 4 experts
    got = launch(_loaded, into, directory, into, False, timeout=300)
    for rank in got:  # every layer's rows, gathered over the stages
        assert torch.equal(rank["bias"], written["bias"])
    if into == 1:
        want = written["logits"][..., : got[0]["logits"].shape[-1]]
        assert want.abs().max() > 0.1
        # Megatron-Core's routing rounds to fp32 (its softmax over experts: the logits agree
        # to ~1e-7, not 1e-12).
        assert (got[0]["logits"] - want).abs().max() < 1e-6


@pytest.mark.parametrize("name", ["pp2-into-pp2", "pp2-into-pp1"])
def test_local_layer_numbers_are_caught(files, name):
    pp, vpp, into = LOADS[name]
    directory, written = files[pp, vpp]
    got = launch(_loaded, into, directory, into, True, timeout=300)
    assert not torch.equal(got[-1]["bias"], written["bias"])


def _converted_in_megatron_core(directory: str) -> dict:
    """Megatron-LM's checkpoint in ``directory`` (legacy or torch_dist), whole
    (megatron_checkpoint.read_megatron), loaded strictly by Megatron-Core's GPTModel of its
    args: its routers' expert biases [layers, E] (zero for dense layers) and float64 logits."""
    from megart.training.megatron_checkpoint import read_megatron

    cfg, model, _ = read_megatron(directory)
    theirs = mcw.megatron_model(cfg)
    extra = {k: v for k, v in theirs.state_dict().items() if k.endswith("_extra_state")}
    bias = {k: v for k, v in model.items() if k.endswith(".mlp.router.expert_bias")}
    # torch_dist's read keeps the fused norms' names: the local spec's through megart's names.
    rest = {k: v for k, v in model.items() if k not in bias}
    weights = to_megatron(from_megatron(rest, cfg), cfg)
    theirs.load_state_dict({**weights, **bias, **extra}, strict=True)
    rows = torch.zeros(cfg.num_layers, cfg.num_experts)
    for i, layer in enumerate(theirs.decoder.layers):
        if hasattr(layer.mlp, "router"):
            rows[i] = layer.mlp.router.expert_bias
    return dict(bias=rows, logits=mcw.megatron_logits(theirs.eval(), TOKENS))


def test_convert_checkpoint_carries_the_expert_biases_both_ways(files, tmp_path):
    """Megatron-LM's pp2 files -> megart's release checkpoint (its record of every layer's
    biases) -> Megatron-LM's files (pp1 legacy, and torch_dist), which Megatron-Core loads
    strictly with the first files' biases and logits."""
    from megart.cli.main import main
    from megart.training import checkpoint

    directory, written = files[2, 1]
    back = tmp_path / "megart"
    convert = ["convert-checkpoint", "--load"]
    assert main([*convert, directory, "--save", str(back), "--from", "megatron",
                 "--to", "megart"]) == 0  # fmt: skip
    state = checkpoint.read_file(checkpoint.iteration_dir(back, 0) / "mp_rank_00" /
                                 checkpoint.FILE)  # fmt: skip
    assert torch.equal(state["expert_bias"], written["bias"])
    for fmt in ("torch", "torch_dist"):
        out = tmp_path / fmt
        assert main([*convert, str(back), "--save", str(out), "--from", "megart", "--to",
                     "megatron", "--ckpt-format", fmt]) == 0  # fmt: skip
        got = launch(_converted_in_megatron_core, 1, str(out), timeout=300)[0]
        assert torch.equal(got["bias"], written["bias"]), fmt
        assert (got["logits"] - written["logits"]).abs().max() < 1e-12, fmt


def _megatron_core_names() -> dict:
    """Megatron-Core's GPTModel of KW: its state dict's keys, those megart takes for expert
    biases (with their layers) and for parameters, its own parameters' names, its MoE layers."""
    model = mcw.megatron_model(tw.tiny(**KW).gpt_config())
    state = model.state_dict()
    return dict(
        biases={k: expert_bias_layer(k) for k in state if expert_bias_layer(k) is not None},
        params=[k for k, v in state.items() if is_parameter(k, v)],
        theirs=[n for n, _ in model.named_parameters()],
        moe=[i for i, layer in enumerate(model.decoder.layers) if hasattr(layer.mlp, "router")],
    )


def test_the_expert_bias_key_is_megatron_cores():
    got = launch(_megatron_core_names, 1, timeout=300)[0]
    assert got["moe"] == [0, 2, 3]
    assert got["biases"] == {expert_bias_key(i): i for i in got["moe"]}
    assert got["params"] == got["theirs"]
