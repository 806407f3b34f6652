"""tests/sweep.py's hf mode: a model of a Hugging Face family, trained in a drawn layout and
checkpoint format, exported by megart export-hf, must be the model one process trains (its
transformers logits those of the one-process run's live GPT.save_hf export); megart's
GPT.from_hf must give transformers' logits; and the export, imported by megart import-hf (as
one file or as a drawn layout's files), must train in another drawn layout as the one-process
import of the live export does."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import torch

import train_workers as tw

# Of logits, relative to the largest: two fp32 layouts' weights after two steps differ by
# reordered sums (about 1e-7 relative); transformers and megart compute attention and GeLU
# with different arithmetic.
LOGITS = 1e-5


def family(rng: random.Random) -> tuple[str, dict]:
    """(a Hugging Face family, megart train's model flags of one of its models)."""
    name = rng.choice(["gpt2", "llama", "qwen3", "qwen2", "mistral", "nemotron"])
    model: dict = dict(num_layers=rng.choice([4, 8]))
    if rng.random() < 0.2:
        model["vocab_size"] = 300  # padded to the tensor-parallel multiple
    if rng.random() < 0.2:
        model["apply_layernorm_1p"] = True  # weights stored as weight - 1
    if name == "gpt2":
        return name, model
    if name == "nemotron":  # squared ReLU, zero-centred LayerNorm, part of each head turning
        model.update(squared_relu=True, apply_layernorm_1p=True, position_embedding_type="rope",
                     rotary_percent=rng.choice([0.5, 1.0]), disable_bias_linear=rng.random() < 0.7,
                     untie_embeddings_and_output_weights=rng.random() < 0.7)  # fmt: skip
        if rng.random() < 0.5:
            model.update(group_query_attention=True, num_query_groups=rng.choice([1, 2]))
        if rng.random() < 0.25:
            model["kv_channels"] = 16
        return name, model
    model.update(normalization="RMSNorm", position_embedding_type="rope", swiglu=True)
    for flag, value, chance in (("rotary_interleaved", True, 0.2), ("rotary_base", 500000, 0.3),
                                ("use_rope_scaling", True, 0.2),
                                ("kv_channels", 16, 0.25)):  # fmt: skip
        if rng.random() < chance:
            model[flag] = value
    if rng.random() < 0.5:
        model.update(group_query_attention=True, num_query_groups=rng.choice([1, 2]))
    if rng.random() < 0.5:
        model["untie_embeddings_and_output_weights"] = True
    if name == "llama":
        model["disable_bias_linear"] = rng.random() < 0.7
        return name, model
    model["disable_bias_linear"] = True
    if name == "qwen3":
        model["qk_layernorm"] = True
    if name == "qwen2":
        model["add_qkv_bias"] = True
    if name == "mistral" or rng.random() < 0.3:
        model["window_size"] = rng.choice(["5,0", "3,0"])
        if name != "mistral" and rng.random() < 0.5:
            model["window_attn_skip_freq"] = "2"
    return name, model


def logits(hf_dir: Path, megart: bool = False) -> torch.Tensor:
    """The logits of transformers' model in ``hf_dir`` (or megart's GPT.from_hf of it) on
    fixed tokens."""
    import transformers

    from megart.models import GPT

    transformers.utils.logging.disable_progress_bar()

    vocab = int(transformers.AutoConfig.from_pretrained(hf_dir).vocab_size)
    x = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(3))
    if megart:
        model = GPT.from_hf(str(hf_dir)).eval()
        with torch.no_grad():
            return model(x)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        return model(x).logits


def apart(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _live_export(kw: dict, hf_dir: str) -> dict:
    return tw.weights_after_training(kw, hf_dir)


def verdict(rng: random.Random, draw_layout, launch, judge, failed) -> str:
    """One drawn case's line (tests/sweep.py's verdicts): ``draw_layout(rng, layers)`` gives
    (ranks, flags, data-parallel size); ``judge`` compares loss curves."""
    from megart.training.export_hf import export_checkpoint
    from megart.training.import_hf import import_checkpoint

    name, model = family(rng)
    ranks, layout, dp = draw_layout(rng, model["num_layers"])
    micro = rng.choice([1, 2])
    model.update(micro_batch_size=micro, global_batch_size=micro * dp * 4, train_iters=2)
    fmt = rng.choice(["megart", "torch", "torch_dist"])
    what = f"{name} {model} {fmt} {layout}"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        try:
            launch(_live_export, 1, model, str(root / "live"), timeout=300)
            save = dict(model, **layout, save=str(root / "ckpt"), ckpt_format=fmt)
            launch(tw.train_kw, ranks, save, timeout=300)
            export_checkpoint(root / "ckpt", root / "hf")
            want = logits(root / "live")
            got, ours = logits(root / "hf"), logits(root / "hf", megart=True)
            off = apart(got, want)
            if max(off, apart(ours, got)) > LOGITS:
                return (
                    f"MISMATCH logits {off:.1e} (export against one process), "
                    f"{apart(ours, got):.1e} (megart against transformers) {ranks} ranks {what}"
                )
            # The export back in: another layout, as one file or as that layout's files.
            ranks, layout, _ = draw_layout(rng, model["num_layers"])
            split = rng.random() < 0.5
            shape = dict(
                tp=layout["tensor_model_parallel_size"], pp=layout["pipeline_model_parallel_size"]
            )
            what += f"; imported {f'as {shape}' if split else 'as one file'} into {layout}"
            # Hugging Face's rope turns halves: the import is such a model (megart's
            # interleaved rotation is reordered into it); --apply-layernorm-1p is import-hf's too.
            one_p = model.get("apply_layernorm_1p", False)
            import_checkpoint(root / "hf", root / "in", 16, one_p, **(shape if split else {}))
            import_checkpoint(root / "live", root / "in-live", 16, one_p)
            tune = dict(model, global_batch_size=micro * 2 * 4, lr_warmup_iters=0)
            tune.pop("rotary_interleaved", None)
            straight = launch(tw.train_kw, 1, dict(tune, load=str(root / "in-live")), timeout=300)
            tune.update(layout, load=str(root / "in"))
            histories = launch(tw.train_kw, ranks, tune, timeout=300)
        except Exception as e:  # noqa: BLE001 (every failure is a verdict, printed)
            return failed(e, f"{ranks} ranks {what}")
    return f"{judge(histories, straight[0], 'hf')} (logits {off:.1e}) {ranks} ranks {what}"


def transformers_model(rng: random.Random):  # noqa: ANN201 (a transformers PreTrainedModel)
    """transformers' own randomly initialised model of a drawn family and config."""
    import transformers

    name = rng.choice(["gpt2", "llama", "qwen2", "qwen3", "mistral", "nemotron"])
    layers, vocab = rng.choice([2, 4]), rng.choice([256, 300])
    torch.manual_seed(rng.randrange(1 << 16))
    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab, n_positions=rng.choice([16, 32]), n_embd=32, n_layer=layers,
            n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            layer_norm_epsilon=rng.choice([1e-5, 1e-6]),
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    kw = dict(
        vocab_size=vocab, hidden_size=rng.choice([32, 64]), intermediate_size=rng.choice([64, 96]),
        num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=rng.choice([1, 2, 4]), max_position_embeddings=64,
        rms_norm_eps=rng.choice([1e-5, 1e-6]), tie_word_embeddings=rng.random() < 0.5,
        rope_theta=rng.choice([10000.0, 500000.0]),
    )  # fmt: skip
    if name == "llama":
        kw.update(attention_bias=rng.random() < 0.3, mlp_bias=rng.random() < 0.3)
        if rng.random() < 0.3:
            kw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}  # fmt: skip
    if name == "mistral" and rng.random() < 0.7:
        kw["sliding_window"] = rng.choice([4, 6])
    if name in ("qwen2", "qwen3") and rng.random() < 0.4:
        kw.update(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    # Qwen3's config defaults to heads 128 wide whatever the hidden size; --kv-channels.
    kw["head_dim"] = rng.choice([kw["hidden_size"] // 4, 16])
    if name == "nemotron":  # its own names for the norm's epsilon and the rope
        rope = {"rope_type": "default", "rope_theta": kw.pop("rope_theta"),
                "partial_rotary_factor": rng.choice([0.25, 0.5, 1.0])}  # fmt: skip
        bias = rng.random() < 0.3
        kw.update(norm_eps=kw.pop("rms_norm_eps"), rope_parameters=rope, attention_bias=bias,
                  mlp_bias=bias)  # fmt: skip
    classes = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
               "nemotron": "Nemotron"}  # fmt: skip
    prefix = classes[name]
    config = getattr(transformers, f"{prefix}Config")(**kw)
    return getattr(transformers, f"{prefix}ForCausalLM")(config)


def import_verdict(rng: random.Random, draw_layout, launch, failed) -> str:
    """tests/sweep.py's hf-import mode: transformers' own model of a drawn family and config,
    imported by import-hf (one file or a drawn layout's files), loads in a drawn layout and
    trains its first iteration at the loss transformers computes on that batch."""
    from megart.training import checkpoint_args
    from megart.training.import_hf import import_checkpoint

    model = transformers_model(rng)
    layers = (
        model.config.num_hidden_layers
        if hasattr(model.config, "num_hidden_layers")
        else (model.config.n_layer)
    )
    ranks, layout, dp = draw_layout(rng, layers)
    split = rng.random() < 0.5
    shape = dict(tp=layout["tensor_model_parallel_size"], pp=layout["pipeline_model_parallel_size"])
    micro = rng.choice([1, 2])
    what = f"{model.config.to_diff_dict()} imported {f'as {shape}' if split else 'as one file'}"
    what += f" into {layout}"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        try:
            model.save_pretrained(root / "hf")
            import_checkpoint(root / "hf", root / "ckpt", 16, **(shape if split else {}))
            kw = checkpoint_args.apply({"load": str(root / "ckpt")}, say=lambda _: None)
            kw.update(layout, load=str(root / "ckpt"), train_iters=1, lr_warmup_iters=0,
                      micro_batch_size=micro, global_batch_size=micro * dp * 4,
                      hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
            runs = launch(tw.loaded_and_first_step, ranks, kw, timeout=300)
        except Exception as e:  # noqa: BLE001 (every failure is a verdict, printed)
            return failed(e, f"{ranks} ranks {what}")
    _, history, (inputs, targets) = runs[0]
    with torch.no_grad():
        logits = model.eval()(inputs).logits
    want = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    off = max(abs(h[0]["loss"] - want) / want for _, h, _ in runs)
    return f"{'OK' if off < LOGITS else 'MISMATCH'} {off:.1e} {ranks} ranks {what}"
