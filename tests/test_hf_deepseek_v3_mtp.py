"""DeepSeek-V3's multi-token prediction layers in Hugging Face files
(megart.models.hf_deepseek_v3_mtp): megart's depths read from layers L + k against an
independent float64 reference built of transformers' own modules (its MtpLayer, which
concatenates enorm(embedding) before hnorm(hidden) as vLLM's deepseek_mtp and Megatron-Core do,
holding transformers' DeepseekV3DecoderLayer with layer L + k's weights and its RMSNorms; the
shared head is transformers' lm_head), depth by depth: the logits and each depth's loss. The
files round trip bitwise (GPT.save_hf, and import-hf then export-hf with the depths' expert
biases); an imported model fine-tunes at pp2 from the same first losses, the depths' included,
as one process and the reference; what megart cannot hold is refused by name, and config.json's
num_nextn_predict_layers without the layers in the files (transformers' own save_pretrained)
is the model without them, said once."""

import dataclasses
import json
import shlex
import warnings

import pytest
import torch

import megatron_core_ckpt_workers as mckw
import train_workers as tw
from megart import ConfigError
from megart.cli.main import main as megart_main
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.models import hf_deepseek_v3 as dsv3
from megart.models import hf_deepseek_v3_mtp as dsv3_mtp
from megart.models.hf import read_format, writer
from megart.training.config import TrainConfig
from megart.training.export_hf import export_checkpoint
from megart.training.import_hf import import_for_training
from test_hf_deepseek_v3 import BOUND, HF_TINY, MLA, saved
from test_hf_llama import relative_error, train_config

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")
from transformers.modeling_layers import MtpLayer  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_modeling  # noqa: E402

L = HF_TINY["num_hidden_layers"]
DATA = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(4))


def released(root, depths: int = 2, layers: int = L, **changes) -> tuple[object, list]:
    """DeepSeek-V3's released layout in ``root``: transformers' DeepseekV3ForCausalLM of
    HF_TINY with ``layers`` + ``depths`` layers drawn and saved (test_hf_deepseek_v3.saved),
    config.json then saying ``layers`` and ``depths`` num_nextn_predict_layers, layer
    ``layers`` + k's files joined by depth k's enorm, hnorm, eh_proj and shared_head.norm
    (drawn in float32) and copies of the embedding and output layer. Returns transformers'
    main model loaded from ``root`` and the depths as transformers' MtpLayers (the drawn
    decoder layer ``layers`` + k inside), in float64."""
    big = saved(root, num_hidden_layers=layers + depths, num_nextn_predict_layers=depths, **changes)
    path = root / "model.safetensors"
    tensors = safetensors.load_file(str(path))
    head = "model.embed_tokens.weight" if big.config.tie_word_embeddings else "lm_head.weight"
    h, g = HF_TINY["hidden_size"], torch.Generator().manual_seed(7)
    mtp_config = big.config.get_mtp_config()  # transformers' own: its layers have experts
    mtp = []
    for k in range(depths):
        own = {
            "enorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
            "hnorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
            "eh_proj.weight": 0.3 * torch.randn(h, 2 * h, generator=g),
            "shared_head.norm.weight": 1 + 0.3 * torch.randn(h, generator=g),
            "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
            "shared_head.head.weight": tensors[head].clone(),
        }
        tensors.update({f"model.layers.{layers + k}.{n}": w for n, w in own.items()})
        norm = hf_modeling.DeepseekV3RMSNorm
        layer = MtpLayer(mtp_config, hf_modeling.DeepseekV3DecoderLayer, norm, k).double()
        layer.mtp_block = big.model.layers[layers + k]
        with torch.no_grad():
            modules = dict(enorm=layer.enorm, hnorm=layer.hnorm, eh_proj=layer.eh_proj)
            for name, module in {**modules, "shared_head.norm": layer.post_norm}.items():
                module.weight.copy_(own[name + ".weight"])
        mtp.append(layer.eval())
    safetensors.save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    main = transformers.DeepseekV3ForCausalLM.from_pretrained(
        str(root), experts_implementation="eager"
    )
    return main.double().eval(), mtp


def shifted(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` [b, s] shifted left by ``k``, zeros shifted in."""
    return torch.cat([x[:, k:], torch.zeros_like(x[:, :k])], 1)


def reference(main, layers: list, tokens: torch.Tensor) -> torch.Tensor:
    """[1 + D, b, s, V]: transformers' logits, then each depth's as transformers' MtpModel
    chains them (its MtpLayer on the previous depth's normed output and the embedding of the
    tokens shifted by the depth, at those tokens' positions; the shared lm_head)."""
    s = tokens.shape[1]
    causal = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        h = main.model(tokens).last_hidden_state  # after the final norm
        out = [main.lm_head(h)]
        for k, layer in enumerate(layers, 1):
            ids = shifted(tokens, k)
            positions = torch.arange(k, s + k).expand_as(ids)
            e = main.model.embed_tokens(ids)
            rope = main.model.rotary_emb(e, position_ids=positions)
            h = layer(e, h, rope, causal, positions, cache=None)
            out.append(main.lm_head(h))
    return torch.stack(out)


def reference_losses(logits: torch.Tensor, labels: torch.Tensor) -> list[float]:
    """The main loss and depth k's: the mean over the positions whose labels, shifted left by
    k, are tokens (Megatron-Core's depth loss: the shifted-off end masked out)."""
    s, ce = labels.shape[1], torch.nn.functional.cross_entropy
    return [
        ce(logits[k][:, : s - k].flatten(0, 1), labels[:, k:].flatten()).item()
        for k in range(len(logits))
    ]


def megart_depths(model, tokens: torch.Tensor, labels: torch.Tensor) -> tuple:
    """megart's logits [1 + D, b, s, V] (its chunk's, with the depths' after the main ones:
    gradients on, as the depths run in training) and its main and depth losses (the ones the
    depths seed into the backward, models.mtp)."""
    depths = model.cfg.mtp_num_layers
    flat = model.chunk(tokens)[..., : model.cfg.vocab_size]
    logits = flat.reshape(1 + depths, tokens.shape[1], *flat.shape[1:]).transpose(1, 2)
    loss = model(tokens, labels)
    loss.backward()
    tracked = model.chunk.aux_loss_scale.take()["mtp"]
    return logits.detach(), [loss.item(), *(tracked[k].item() for k in range(depths))]


@pytest.mark.parametrize("changes", [{}, dict(tie_word_embeddings=True, depths=1)],
                         ids=["two-depths-untied", "one-depth-tied"])  # fmt: skip
def test_megarts_depths_are_transformers_modules_on_layers_l_plus_k(tmp_path, changes):
    changes = dict(changes)
    main, layers = released(tmp_path, changes.pop("depths", 2), **changes)
    tokens, labels = DATA[:, :-1], DATA[:, 1:]
    want = reference(main, layers, tokens)
    ours = GPT.from_hf(str(tmp_path)).double()
    assert ours.cfg.mtp_num_layers == len(layers)
    logits, losses = megart_depths(ours, tokens, labels)
    for k in range(len(want)):  # the main logits, then each depth's
        assert relative_error(logits[k], want[k]) < BOUND, k
    assert losses == pytest.approx(reference_losses(want, labels), rel=BOUND)
    assert all(2 < x < 30 for x in losses)  # untrained, drawn weights: losses, not zeros


@pytest.mark.parametrize("mistake", ["concatenation-swapped", "enorm-hnorm-swapped"])
def test_a_wrong_depth_mapping_fails_the_bound(tmp_path, monkeypatch, mistake):
    """eh_proj's halves taken the other way round (as a depth that concatenates the hidden
    states first), or enorm read as hnorm and back: the depths' logits leave transformers'."""
    main, layers = released(tmp_path)
    if mistake == "enorm-hnorm-swapped":
        swapped = (("enorm", "hnorm"), ("hnorm", "enorm"), *dsv3_mtp.OWN[2:])
        monkeypatch.setattr(dsv3_mtp, "OWN", swapped)
    else:
        real = dsv3._reordered

        def reordered(cfg, ours, w, to_megart):
            w = real(cfg, ours, w, to_megart)
            return w.roll(w.shape[1] // 2, 1) if ours.endswith("eh_proj.weight") else w

        monkeypatch.setattr(dsv3, "_reordered", reordered)
    tokens = DATA[:, :-1]
    want = reference(main, layers, tokens)
    logits, _ = megart_depths(GPT.from_hf(str(tmp_path)).double(), tokens, DATA[:, 1:])
    assert relative_error(logits[0], want[0]) < BOUND  # the main model is not touched
    assert min(relative_error(logits[k], want[k]) for k in (1, 2)) > 100 * BOUND


def test_the_files_round_trip_bitwise_with_the_depths(tmp_path):
    """GPT.save_hf, and import-hf then export-hf through a checkpoint (every layer's expert
    bias kept beside the weights, the depths' too), write the files read, tensor for tensor;
    transformers reads the main model back to its logits."""
    main, _ = released(tmp_path / "hf")
    given = safetensors.load_file(str(tmp_path / "hf" / "model.safetensors"))
    GPT.from_hf(str(tmp_path / "hf")).save_hf(str(tmp_path / "back"))
    said = import_for_training(tmp_path / "hf", tmp_path / "ckpt")
    assert "--mtp-num-layers 2" in said and "num_nextn_predict_layers" not in said
    recorded = ["--load", str(tmp_path / "ckpt"), "--use-checkpoint-args"]
    assert train_config(recorded).mtp_num_layers == 2  # the checkpoint records the depths
    exported = export_checkpoint(tmp_path / "ckpt", tmp_path / "exported")
    for out in (tmp_path / "back", exported):
        written = safetensors.load_file(str(out / "model.safetensors"))
        assert written.keys() == given.keys()
        assert all(torch.equal(written[k], given[k]) for k in given)
        config = json.loads((out / "config.json").read_text())
        assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (L, 2)
    # import-hf --apply-layernorm-1p stores every norm centred, the depths' too, once.
    import_for_training(tmp_path / "hf", tmp_path / "ckpt-1p", apply_layernorm_1p=True)
    centred = mckw.checkpoint_gpt(str(tmp_path / "ckpt-1p"))[1]
    for ours, theirs in [("blocks.0.ln_1", "layers.0.input_layernorm"),
                         ("mtp.layers.1.enorm", f"layers.{L + 1}.enorm"),
                         ("mtp.layers.1.final_layernorm", f"layers.{L + 1}.shared_head.norm"),
                         ("mtp.layers.0.transformer_layer.attn.kv_layernorm",
                          f"layers.{L}.self_attn.kv_a_layernorm")]:  # fmt: skip
        assert torch.equal(centred[ours + ".weight"], given[f"model.{theirs}.weight"].double() - 1)
    bias = f"model.layers.{L + 1}.mlp.gate.e_score_correction_bias"
    assert given[bias].abs().sum() > 0
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(
        str(exported), experts_implementation="eager"
    )
    with torch.no_grad():
        got, want = back.double().eval()(DATA).logits, main(DATA).logits
    assert relative_error(got, want) < 1e-12


def test_a_config_without_the_layers_in_the_files_is_the_main_model_said_once(tmp_path, capsys):
    """transformers' save_pretrained of a config with num_nextn_predict_layers 1 writes no
    layer L: read without multi-token prediction, import-hf's line and GPT.from_hf's warning
    say so."""
    saved(tmp_path / "hf", num_nextn_predict_layers=1)
    assert read_format(tmp_path / "hf")[1].mtp_num_layers is None
    argv = ["import-hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]
    assert megart_main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("num_nextn_predict_layers 1 but its files hold no layer 3") == 1
    assert "--mtp-num-layers 1" not in out  # the flags printed: the main model's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert GPT.from_hf(str(tmp_path / "hf")).cfg.mtp_num_layers is None
    assert [str(w.message).count("hold no layer 3") for w in caught] == [1]


def _edit_files(root, change) -> None:
    path = root / "model.safetensors"
    tensors = safetensors.load_file(str(path))
    change(tensors)
    safetensors.save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t[f"model.layers.{L}.embed_tokens.weight"].add_(1e-3),
         f"model.layers.{L}.embed_tokens.weight differs from model.embed_tokens.weight "
         r"\(by up to 0.001\)"),
        (lambda t: t[f"model.layers.{L + 1}.shared_head.head.weight"].mul_(2),
         f"model.layers.{L + 1}.shared_head.head.weight differs from lm_head.weight"),
        (lambda t: [t.pop(k) for k in list(t) if k.startswith(f"model.layers.{L + 1}.")],
         r"num_nextn_predict_layers 2 but its files hold only layers \[3\] of \[3, 4\]"),
    ],
    ids=["embedding-copy", "head-copy", "one-of-two-layers"],
)  # fmt: skip
def test_what_megart_cannot_read_of_the_depths_is_refused_by_name(tmp_path, edit, message):
    released(tmp_path)
    _edit_files(tmp_path, edit)
    with pytest.raises(ConfigError, match=f"this DeepSeek-V3.*{message}"):
        GPT.from_hf(str(tmp_path))


def test_a_depth_of_another_kind_than_the_last_layer_is_refused(tmp_path):
    """All L layers dense (first_k_dense_replace L) where the depth's layer has experts (as
    transformers' MtpModel always builds it): megart's depth would be dense."""
    released(tmp_path, 1, first_k_dense_replace=L)
    with pytest.raises(ConfigError, match="prediction layer 3 is with experts where its last"):
        read_format(tmp_path)


def test_export_of_depths_is_refused_for_the_other_families_and_dense_depths():
    llama = dict(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                 normalization="rmsnorm", position_embedding="rotary", activation="swiglu",
                 bias=False, mtp_num_layers=1)  # fmt: skip
    with pytest.raises(ConfigError, match="Hugging Face's formats but DeepSeek-V3's"):
        writer(GPTConfig(**llama))
    with pytest.raises(ConfigError, match="--mtp-num-layers 1 with a dense last layer"):
        writer(GPTConfig(**MLA, mtp_num_layers=1))


def test_an_imported_model_with_depths_fine_tunes_at_pp2_and_tp2_from_the_same_losses(tmp_path):
    """import-hf's printed flags (--mtp-num-layers 2 among them) train one process, two
    pipeline stages (the depths on the last) and, from an import split for tp2, two
    tensor-parallel ranks with sequence parallelism (eh_proj's rows split): their first main
    and depth losses agree, and are the reference's on the batch trained (float32 training
    against float64); the stages together loaded GPT.from_hf's weights."""
    main, layers = released(tmp_path / "hf", layers=4, vocab_size=256)
    said = import_for_training(tmp_path / "hf", tmp_path / "ckpt")
    import_for_training(tmp_path / "hf", tmp_path / "ckpt-tp2", tp=2)
    flags = shlex.split(said.split(f"or with --load {tmp_path / 'ckpt'} ")[1])
    assert "--mtp-num-layers" in flags
    given = dataclasses.asdict(train_config(flags))
    model = {k: v for k, v in given.items() if v != getattr(TrainConfig(), k)}
    kw = dict(model, load=str(tmp_path / "ckpt"), train_iters=2, lr_warmup_iters=0,
              seq_length=16, hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    names = ("loss", "mtp_1 loss", "mtp_2 loss")
    one = launch(tw.loaded_and_first_step, 1, kw, timeout=300, env=tw.ONE_THREAD)[0]
    staged = launch(tw.loaded_and_first_step, 2, dict(kw, pipeline_model_parallel_size=2),
                    timeout=300)  # fmt: skip
    split = launch(tw.loaded_and_first_step, 2, dict(kw, load=str(tmp_path / "ckpt-tp2"),
                   tensor_model_parallel_size=2, sequence_parallel=True), timeout=300)  # fmt: skip
    first = [one[1][0][n] for n in names]
    for _, history, _ in staged + split:
        assert [history[0][n] for n in names] == pytest.approx(first, rel=5e-6)
    inputs, targets = one[2]
    want = reference_losses(reference(main, layers, inputs), targets)
    assert first == pytest.approx(want, rel=1e-5)
    assert one[1][1]["loss"] < first[0]
    reference_weights = dict(GPT.from_hf(str(tmp_path / "hf")).named_parameters())
    loaded = {**staged[0][0], **staged[1][0]}
    assert loaded.keys() == reference_weights.keys()
    assert "chunk.mtp.layers.1.eh_proj.weight" in loaded
    for weights in (loaded, split[0][0]):
        assert all(
            torch.equal(v, reference_weights[n].detach()[: len(v)]) for n, v in weights.items()
        )
