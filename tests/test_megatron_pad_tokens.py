"""--data-order megatron's inputs, labels, loss masks, positions and attention masks equal
Megatron-Core 0.16.1's GPTDataset items sample by sample: with a Hugging Face tokenizer whose
pad id is distinct (its labels masked, the id read as 0), one whose pad id is its end of
document (masked only under --allow-ambiguous-pad-tokens) and one without a pad, each with and
without --eod-mask-loss, --reset-position-ids and --reset-attention-mask. Megatron's side is
built as Megatron-LM builds it: its own tokenizer (megatron.core.tokenizers' build_tokenizer)
and its BlendedMegatronDatasetBuilder on the same files."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megart.training.config import TrainConfig
from megart.training.documents import DocumentBatches, MaskedTargets, rank_microbatches
from megart.training.indexed import write_indexed
from megart.training.megatron_blend import megatron_datasets, num_samples
from megart.training.pad_tokens import megatron_pad_id

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

VOCAB = 40  # [UNK] 0, </s> 1 (end of document), <pad> 2, then words
EOS, PAD = 1, 2
# Each tokenizer's end-of-document id: "eos0" swaps [UNK] and </s>, so that a pad read as 0
# looks like an end of document (the document masks must be found before that mapping).
EOD_OF = {"distinct": EOS, "eos": EOS, "none": EOS, "eos0": 0}
DOCUMENT_FLAGS = ("eod_mask_loss", "reset_position_ids", "reset_attention_mask")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, str]:
    """Hugging Face tokenizers: pad <pad> (distinct), pad </s> (the end of document), no pad,
    and pad <pad> with </s> at id 0."""
    import tokenizers as tk
    from transformers import PreTrainedTokenizerFast

    where = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for kind, pad in (("distinct", "<pad>"), ("eos", "</s>"), ("none", None), ("eos0", "<pad>")):
        eod = EOD_OF[kind]
        vocab = {"[UNK]": 1 - eod, "</s>": eod, "<pad>": PAD} | {
            f"w{i}": i for i in range(3, VOCAB)
        }
        model = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="[UNK]"))
        model.pre_tokenizer = tk.pre_tokenizers.Whitespace()
        extra = {} if pad is None else {"pad_token": pad}
        fast = PreTrainedTokenizerFast(
            tokenizer_object=model, unk_token="[UNK]", eos_token="</s>", **extra
        )
        fast.save_pretrained(where / kind)
        out[kind] = str(where / kind)
    return out


# BlendedDataset asks torch.distributed for its rank (conftest).
pytestmark = pytest.mark.usefixtures("torch_group_of_one")


def _megatron_tokenizer(cfg: TrainConfig):
    """The tokenizer Megatron-LM builds for these flags (its default tokenizer system)."""
    args = SimpleNamespace(
        tokenizer_type=cfg.tokenizer_type,
        tokenizer_model=cfg.tokenizer_model,
        vocab_file=None,
        merge_file=None,
        vocab_size=cfg.vocab_size,
        tokenizer_special_tokens=None,
        tokenizer_hf_use_fast=True,
        trust_remote_code=False,
        tokenizer_hf_include_special_tokens=False,
        tokenizer_metadata=None,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_tokenizer(args)


def _megatron_train(cfg: TrainConfig, cache) -> GPTDataset:
    config = GPTDatasetConfig(
        random_seed=cfg.seed,
        sequence_length=cfg.seq_length,
        blend=get_blend_from_list([cfg.data_path]),
        split=cfg.split,
        path_to_cache=str(cache),
        tokenizer=_megatron_tokenizer(cfg),
        reset_position_ids=cfg.reset_position_ids,
        reset_attention_mask=cfg.reset_attention_mask,
        eod_mask_loss=cfg.eod_mask_loss,
        allow_ambiguous_pad_tokens=cfg.allow_ambiguous_pad_tokens,
        mid_level_dataset_surplus=0.005,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        builder = BlendedMegatronDatasetBuilder(
            GPTDataset, list(num_samples(cfg)), lambda: True, config
        )
        return builder.build()[0]


def _config(tokenizer_model: str, prefix: str, **kw) -> TrainConfig:
    base = dict(data_path=prefix, data_order="megatron", tokenizer_type="HuggingFaceTokenizer",
                tokenizer_model=tokenizer_model, vocab_size=VOCAB, seq_length=16,
                micro_batch_size=1, global_batch_size=4, train_iters=6, eval_interval=6,
                eval_iters=1, split="90,10,0", seed=1234)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def _documents(
    rng: np.random.Generator, lengths: list[int], eos: float, pad: float, eod: int = EOS
) -> list:
    """Word tokens with end-of-document and pad ids sprinkled at the given shares (documents
    need not end with one: the data is what Megatron reads, whatever made it)."""
    out = []
    for n in lengths:
        tokens = rng.integers(3, VOCAB, n)
        draw = rng.random(n)
        tokens[draw < eos + pad] = PAD
        tokens[draw < eos] = eod
        out.append(tokens)
    return out


def _assert_megatrons_items(cfg: TrainConfig, cache) -> None:
    """Every training sample as megart's trainer gets it (one process, one sample per
    microbatch) against Megatron-Core's GPTDataset item."""
    train = megatron_datasets(cfg, dp=1)[0]
    theirs = _megatron_train(cfg, cache)
    n = num_samples(cfg)[0]
    batches = DocumentBatches(cfg, 1, megatron_pad_id(cfg))
    inputs, targets, documents = rank_microbatches(
        cfg, batches, train.global_batch(cfg.seed, 0, n), 1, 0, 0, torch.device("cpu")
    )
    s = cfg.seq_length
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for k in range(n):
        # Megatron-Core caches the loss mask of its first item when no document flag is given,
        # then zeroes that item's pad labels in the cached tensor itself (0.16.1 and today's
        # main): each later item of the process also masks them. Each item is read as a first
        # one here, as Megatron means it (a DataLoader worker's first item is one).
        theirs.masks_and_position_ids_are_cached = False
        item = theirs[k]
        labels = targets[k].labels if isinstance(targets[k], MaskedTargets) else targets[k]
        mask = targets[k].mask if isinstance(targets[k], MaskedTargets) else torch.ones(1, s)
        doc = documents[k] if documents is not None else None
        positions = doc.positions if doc is not None and doc.positions is not None else None
        attend = doc.attention_mask() if doc is not None else None
        assert torch.equal(inputs[k][0], item["tokens"]), k
        assert torch.equal(labels[0], item["labels"]), k
        assert torch.equal(mask[0], item["loss_mask"]), k
        want_positions = torch.arange(s) if positions is None else positions[0]
        assert torch.equal(want_positions, item["position_ids"]), k
        allowed = causal if attend is None else attend[0, 0]
        assert torch.equal(allowed, ~item["attention_mask"][0]), k  # Megatron's True: masked


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.sampled_from(sorted(EOD_OF)),
    ambiguous=st.booleans(),
    flags=st.lists(st.sampled_from(DOCUMENT_FLAGS), unique=True),
    lengths=st.lists(st.integers(1, 40), min_size=10, max_size=40),
    eos=st.sampled_from([0.0, 0.05, 0.2]),
    pad=st.sampled_from([0.0, 0.05, 0.3]),
    seed=st.integers(0, 2**31 - 1),
)
@example(  # a pad read as 0 that would look like an end of document, were masks found after
    kind="eos0", ambiguous=False, flags=["eod_mask_loss", "reset_position_ids"],
    lengths=[30] * 20, eos=0.05, pad=0.3, seed=5,
)  # fmt: skip
def test_every_sample_is_megatron_cores_item(
    tokenizers, tmp_path_factory, kind, ambiguous, flags, lengths, eos, pad, seed
):
    where = tmp_path_factory.mktemp("d")
    rng = np.random.default_rng(seed % 2**32)
    prefix = str(where / "a")
    write_indexed(prefix, _documents(rng, lengths, eos, pad, EOD_OF[kind]), np.uint16)
    on = dict.fromkeys(flags, True)
    cfg = _config(tokenizers[kind], prefix, allow_ambiguous_pad_tokens=ambiguous, seed=seed, **on)
    _assert_megatrons_items(cfg, where / "cache")


def test_which_pad_id_megatron_masks(tokenizers):
    """The pad id is masked when distinct from the end of document, or when it is the end of
    document under --allow-ambiguous-pad-tokens; never without one, never in megart's order,
    never for NullTokenizer or GPT2BPETokenizer (neither has a pad id in Megatron-LM)."""
    prefix = "unused"
    assert megatron_pad_id(_config(tokenizers["distinct"], prefix)) == PAD
    assert megatron_pad_id(_config(tokenizers["eos"], prefix)) is None
    assert megatron_pad_id(_config(tokenizers["eos"], prefix, allow_ambiguous_pad_tokens=True)) == (
        EOS
    )
    assert megatron_pad_id(_config(tokenizers["none"], prefix)) is None
    assert megatron_pad_id(_config(tokenizers["distinct"], prefix, data_order="megart")) is None
    null = _config(tokenizers["distinct"], prefix, tokenizer_type="NullTokenizer")
    assert megatron_pad_id(null) is None
    with pytest.raises(AttributeError):  # Megatron's NullTokenizer: no pad, so no masking
        _megatron_tokenizer(null).pad  # noqa: B018


def test_allow_ambiguous_pad_tokens_is_refused_in_megarts_order(tokenizers):
    from megart import ConfigError

    cfg = _config(tokenizers["eos"], "unused", data_order="megart", allow_ambiguous_pad_tokens=True)
    with pytest.raises(ConfigError, match="--allow-ambiguous-pad-tokens with --data-order megart"):
        cfg.check(1)


def test_a_dp2_run_feeds_each_rank_megatrons_items_and_counts_their_unmasked_tokens(
    tokenizers, tmp_path
):
    """A launched dp2 run with a distinct pad id, --eod-mask-loss and
    --calculate-per-token-loss: each rank's micro batches (inputs, labels, loss masks) are
    Megatron-Core's items of its sampler slice, and the per-token loss divides by the global
    batch's unmasked count in Megatron's masks (the pad labels' included)."""
    import megatron_order_workers as mow
    from megart.launcher import launch

    rng = np.random.default_rng(60)
    prefix = str(tmp_path / "a")
    write_indexed(prefix, _documents(rng, [30] * 60, 0.05, 0.1), np.uint16)
    kw = dict(data_path=prefix, data_order="megatron", tokenizer_type="HuggingFaceTokenizer",
              tokenizer_model=tokenizers["distinct"], seq_length=16, micro_batch_size=2,
              global_batch_size=8, train_iters=2, eval_interval=2, eval_iters=1,
              split="90,10,0", seed=77, eod_mask_loss=True,
              calculate_per_token_loss=True)  # fmt: skip
    fed = launch(mow.fed_masked, 2, kw, timeout=300)
    cfg = TrainConfig(vocab_size=VOCAB, **kw)  # Megatron-Core's masks are uncached here
    train = _megatron_train(cfg, tmp_path / "cache")
    gbs, mbs = cfg.global_batch_size, cfg.micro_batch_size
    for rank, batches in enumerate(fed):
        trained = [b for b in batches if b[0] == "train"]
        assert [b[1] for b in trained] == [0, 1]
        for _, b, inputs, labels, masks, denominator in trained:
            items = [train[i] for i in range(b * gbs, (b + 1) * gbs)]
            unmasked = sum(float(it["loss_mask"].sum()) for it in items)
            assert denominator == pytest.approx(unmasked / (gbs // (mbs * 2) * 2))
            for j in range(gbs // (mbs * 2)):
                # MegatronPretrainingSampler: micro batch j of rank r is samples
                # j*mbs*dp + r*mbs ... + mbs of the global batch.
                want = items[j * mbs * 2 + rank * mbs : j * mbs * 2 + (rank + 1) * mbs]
                assert inputs[j] == [w["tokens"].tolist() for w in want], (rank, b, j)
                assert labels[j] == [w["labels"].tolist() for w in want], (rank, b, j)
                assert masks[j] == [w["loss_mask"].tolist() for w in want], (rank, b, j)
    # Not vacuous: the windows as read hold pad labels (and end-of-document inputs).
    x, y = megatron_datasets(cfg, dp=1)[0].global_batch(cfg.seed, 0, 2 * gbs)
    assert bool((y == PAD).any()) and bool((x == EOS).any())
