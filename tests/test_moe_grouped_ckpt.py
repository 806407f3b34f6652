"""Checkpoint files of megart train with --moe-grouped-gemm (models.moe_grouped: each expert's
weight a view of one stack per projection): every format writes the files it writes without
the flag. megart's and Megatron's legacy files hold each expert's weight over its own bytes
(training.compact_tensors; torch.save would write the stack as one record and torch.load give
back views of it), the same records of the same sizes as without the flag, and the same bytes
for the same weights; torch_dist's stores are the same files. Megatron-Core's own
SequentialMLP MoE model loads --ckpt-format torch and torch_dist files saved with the flag
strictly, with megart's logits and the logits of the files saved without it."""

import zipfile
from pathlib import Path

import pytest
import torch

import train_workers as tw
from megart.launcher import launch
from megart.training.checkpoint_save import write_file
from test_moe_grouped_gemm import layer

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's torch_dist strategy needs it

FORMATS = ("megart", "torch", "torch_dist")
MODEL = dict(num_experts=4, disable_bias_linear=True, moe_aux_loss_coeff=0.01, swiglu=True,
             train_iters=1, save_interval=1)  # fmt: skip


def saved_bytes(state: dict, folder: Path) -> bytes:
    """The bytes megart's checkpoint writer writes for ``state`` (into ``folder``: torch.save
    names its archive's records after the file)."""
    write_file(folder / "model.pt", state)
    return (folder / "model.pt").read_bytes()


def test_a_packed_layer_writes_the_bytes_of_separate_parameters(tmp_path):
    packed, plain = layer(4, 2, "swiglu", True), layer(4, 2, "swiglu", False)
    plain.load_state_dict(packed.state_dict())
    fc = packed.experts[0].fc.weight
    assert fc.untyped_storage().nbytes() == 4 * fc.numel() * fc.element_size()  # one stack
    got = saved_bytes({"model": packed.state_dict()}, tmp_path / "packed")
    assert got == saved_bytes({"model": plain.state_dict()}, tmp_path / "plain")
    # torch.save alone writes each stack as one record of E experts' bytes: not the same file.
    torch.save({"model": packed.state_dict()}, tmp_path / "model.pt")
    assert (tmp_path / "model.pt").read_bytes() != got
    loaded = torch.load(tmp_path / "packed" / "model.pt", weights_only=True)["model"]
    for name, t in loaded.items():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name


def records(path: Path) -> dict[str, int]:
    """A torch.save file's records (its zip entries, the archive's folder name left out) and
    their sizes."""
    with zipfile.ZipFile(path) as z:
        return {i.filename.split("/", 1)[1]: i.file_size for i in z.infolist()}


def files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("fmt", FORMATS)
def test_megart_train_writes_the_files_it_writes_without_the_flag(tmp_path, fmt):
    """The same files, each torch.save file with the same records of the same sizes (its
    pickle aside: Megatron's args record the save directory, which differs between
    runs), each loaded expert weight over its own bytes; a torch_dist store's
    files of the same sizes (directories of the same length: its metadata names it)."""
    stores = {}
    for flag, name in ((True, "with"), (False, "none")):
        stores[flag] = tmp_path / name
        kw = dict(MODEL, ckpt_format=fmt, moe_grouped_gemm=flag, save=str(stores[flag]))
        launch(tw.train_kw, 1, kw, timeout=300)
    got, want = files(stores[True]), files(stores[False])
    assert got.keys() == want.keys()
    saved = [n for n in want if n.endswith(".pt") and "common" not in n]
    for name in want:
        if name in saved:
            a, b = records(stores[True] / name), records(stores[False] / name)
            assert a.keys() == b.keys(), name
            a.pop("data.pkl"), b.pop("data.pkl")
            assert a == b, name
        else:
            assert got[name] == want[name], name
    if fmt == "torch_dist":
        return
    (path,) = saved
    state = torch.load(stores[True] / path, weights_only=False)
    model = state["model"][0] if fmt == "megart" else state["model"]
    experts = [t for n, t in model.items() if ".experts." in n and n.endswith(".weight")]
    assert len(experts) == 4 * 4 * (3 if fmt == "megart" else 2)  # SwiGLU's fc1 [gate; up]
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in experts)


def megatron_core_logits(store: str, fmt: str, tokens: torch.Tensor) -> dict:
    """Megatron-Core's one-rank SequentialMLP MoE GPTModel loading megart train's ``store``
    strictly (--ckpt-format torch: the rank file's own state dict; torch_dist: through
    dist_checkpointing as Megatron-LM's loader), its logits of ``tokens``, and megart's GPT's
    of the same file's weights."""
    import megatron_core_workers as mcw
    import megatron_dist_workers as mdw
    from megart.training.megatron_checkpoint import read_megatron
    from megart.training.megatron_files import torch_load

    cfg, weights, _ = read_megatron(store)
    if fmt == "torch_dist":
        theirs = mdw.load_and_run(store, tokens, 1, 1)
    else:
        model = mcw.megatron_model(cfg)
        (path,) = Path(store).rglob("model_optim_rng.pt")
        state = torch_load(path)["model"]
        extra = {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}
        model.load_state_dict({**state, **extra}, strict=True)
        theirs = mcw.megatron_logits(model, tokens)
    ours = mdw.megart_logits(cfg, weights, tokens)
    return dict(theirs=theirs[..., : ours.shape[-1]], ours=ours, experts=cfg.num_experts)


@pytest.mark.parametrize("fmt", ("torch", "torch_dist"))
def test_megatron_cores_sequential_experts_load_a_file_saved_with_the_flag(tmp_path, fmt):
    """Bound 1e-6: Megatron-Core's routing rounds to fp32 (test_megatron_moe_ckpt's)."""
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(5))
    logits = {}
    for flag in (True, False):
        store = tmp_path / str(flag)
        kw = dict(MODEL, ckpt_format=fmt, moe_grouped_gemm=flag, save=str(store))
        launch(tw.train_kw, 1, kw, timeout=300)
        r = launch(megatron_core_logits, 1, str(store), fmt, tokens, timeout=300)[0]
        assert r["experts"] == 4 and r["ours"].abs().max() > 0.1
        assert (r["theirs"] - r["ours"]).abs().max() < 1e-6
        logits[flag] = r["theirs"]
    # The flag leaves training's curve within 1e-6 relative: so the files' logits.
    assert (logits[True] - logits[False]).abs().max() < 1e-5 * logits[False].abs().max()
