"""Megatron-LM's --eod-mask-loss, --reset-position-ids and --reset-attention-mask: samples cut
into documents after each end-of-document (EOD) input token.

Positions, attention masks and loss masks against a plain reference written from Megatron's
documented semantics and against Megatron-Core's own GPTDataset function; a model under the
documents' mask and positions is each document run on its own (float64); the loss and its
gradient follow Megatron's normalisation (per-microbatch means over unmasked tokens, or with
--calculate-per-token-loss the global batch's), by hand on a tiny batch; `megart train` with the
flags at tp2, pp2 (1f1b and zb-h1, with recomputation), dp2 and cp2 follows the one-process
curve; what megart does not do with them is refused by name."""

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import document_workers as dw
import train_workers as tw
from megart import ConfigError
from megart.launcher import launch
from megart.models.config import GPTConfig
from megart.models.documents import (
    Documents,
    document_attention_mask,
    document_ids,
    document_positions,
    eod_loss_mask,
)
from megart.models.gpt import GPT
from megart.training.documents import eod_token
from megart.training.loss_record import global_loss_and_p2p_bytes

EOD = 5
REL = 5e-6  # as test_context_parallel: multi-rank float32 curves against one process
F64 = 1e-12


def reference(tokens: list[int], eod: int) -> tuple[list[int], list[list[bool]], list[float]]:
    """Positions, may-attend mask and loss mask of one sample, written plainly: a document ends
    at each EOD of the inputs (inclusive); positions count from each document's start; query i
    sees key j when j <= i and no EOD lies in [j, i); the loss of the prediction made from an
    EOD input is masked."""
    s = len(tokens)
    positions, start = [], 0
    for i, t in enumerate(tokens):
        positions.append(i - start)
        if t == eod:
            start = i + 1
    allowed = [[j <= i and eod not in tokens[j:i] for j in range(s)] for i in range(s)]
    loss = [0.0 if t == eod else 1.0 for t in tokens]
    return positions, allowed, loss


samples = st.lists(st.lists(st.sampled_from([EOD, 0, 1, 2, 3]), min_size=1, max_size=24),
                   min_size=1, max_size=3)  # fmt: skip


@settings(max_examples=80, deadline=None)
@given(rows=samples)
def test_positions_and_masks_are_the_plain_reference_and_megatron_cores(rows):
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    s = min(len(r) for r in rows)
    batch = torch.tensor([r[:s] for r in rows])
    positions = document_positions(batch, EOD)
    allowed = document_attention_mask(document_ids(batch, EOD))
    loss = eod_loss_mask(batch, EOD)
    assert allowed.shape == (len(rows), 1, s, s) and loss.dtype == torch.float32
    for b, row in enumerate(batch):
        want_pos, want_allowed, want_loss = reference(row.tolist(), EOD)
        assert positions[b].tolist() == want_pos
        assert allowed[b, 0].tolist() == want_allowed
        assert loss[b].tolist() == want_loss
        masked, core_loss, core_pos = _get_ltor_masks_and_position_ids(
            row.clone(), EOD, True, True, True, True
        )
        assert torch.equal(positions[b], core_pos)
        assert torch.equal(allowed[b], ~masked)  # Megatron-Core's True means masked out
        assert torch.equal(loss[b], core_loss)


def _cfg(**kw) -> GPTConfig:
    base = dict(vocab_size=20, seq_length=24, hidden_size=24, num_layers=2,
                num_attention_heads=4, init_std=0.4)  # fmt: skip
    return GPTConfig(**{**base, **kw})


MODELS = {
    "gpt2": {},
    "llama": dict(position_embedding="rotary", normalization="rmsnorm", activation="swiglu",
                  num_query_groups=2, untie_embeddings_and_output_weights=True),
}  # fmt: skip


@settings(max_examples=15, deadline=None)
@given(
    model=st.sampled_from(sorted(MODELS)),
    ends=st.lists(st.lists(st.integers(0, 23), max_size=4), min_size=2, max_size=2),
    seed=st.integers(0, 2**16),
)
def test_a_model_over_documents_is_each_document_on_its_own(model, ends, seed):
    """float64: the logits of a batch of samples under the documents' mask and positions equal
    those of each document run as a sample of its own; without the mask or the positions they
    differ (where a sample has more than one document)."""
    torch.manual_seed(seed)
    net = GPT(_cfg(**MODELS[model])).double()
    tokens = torch.randint(0, EOD, (2, 24))
    for b, where in enumerate(ends):
        tokens[b, where] = EOD
    ids = document_ids(tokens, EOD)
    documents = Documents(document_positions(tokens, EOD), ids)
    got = net(tokens, documents=documents)
    for b in range(2):
        for d in ids[b].unique():
            cols = (ids[b] == d).nonzero().flatten()
            alone = net(tokens[b : b + 1, cols])[0]
            assert torch.allclose(got[b, cols], alone, rtol=F64, atol=F64)
    if bool((ids[:, -1] > 0).any()):  # more than one document somewhere
        without_mask, without_positions = Documents(documents.positions, None), Documents(None, ids)
        partials = [without_mask]
        # Rope turns only the relative positions of a query and its keys: a later document of
        # one token (its only key itself) gives the same logits at any position (hypothesis
        # found it: a sample ending in an end-of-document and one token).
        later_lengths = [int((ids[b] == d).sum()) for b in range(2) for d in ids[b].unique()[1:]]
        if model == "gpt2" or max(later_lengths) > 1:
            partials.append(without_positions)
        for partial in partials:
            assert (net(tokens, documents=partial) - got).abs().max() > 1e3 * F64


def _masked_objective(trainer, per_token: bool) -> tuple[torch.Tensor, float, torch.nn.Module]:
    """By hand, from the trainer's own weights in float64: the objective whose gradient
    Megatron-LM takes (the mean over microbatches of each one's masked mean, or the global
    batch's masked sum over its unmasked count), and the loss it reports (the latter's value)."""
    c = trainer.config
    exact = GPT(trainer.model_config).chunk
    exact.load_state_dict(trainer.chunks[0].state_dict())
    exact.double()
    inputs, targets = trainer.data.global_batch(c.seed, 0, c.global_batch_size)
    sums, counts = [], []
    for x, y in zip(inputs.split(c.micro_batch_size), targets.split(c.micro_batch_size),
                    strict=True):  # fmt: skip
        logits = exact(x)[..., : c.vocab_size].transpose(0, 1)  # [b, s, V]
        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        mask = (x.flatten() != dw.EOD).double()  # the *input* token
        sums.append((ce * mask).sum())
        counts.append(mask.sum())
    total, count = sum(sums), sum(counts)
    if per_token:
        objective = total / count
    else:
        objective = sum(s / n.clamp(min=1) for s, n in zip(sums, counts, strict=True)) / len(sums)
    return objective, float(total / count), exact


def _by_hand(per_token: bool) -> tuple[float, float, float, float]:
    """In a launched process (a Trainer initialises megart.distributed): the reported loss,
    the hand computation's, the largest relative gradient error, and how far the other
    normalisation's gradient is."""
    trainer = dw.trainer(eod_mask_loss=True, calculate_per_token_loss=per_token)
    objective, reported, exact = _masked_objective(trainer, per_token)
    objective.backward()
    trainer._forward_backward(0, trainer.config.global_batch_size, trainer.m, 1.0)
    loss, _ = global_loss_and_p2p_bytes(trainer.losses, trainer.grid, trainer.device)
    worst = 0.0
    for p, e in zip(trainer.chunks[0].parameters(), exact.parameters(), strict=True):
        grad = p.main_grad if hasattr(p, "main_grad") else p.grad
        worst = max(worst, float((grad.double() - e.grad).norm() / e.grad.norm()))
    other, _, other_exact = _masked_objective(trainer, not per_token)
    other.backward()
    pairs = zip(exact.parameters(), other_exact.parameters(), strict=True)
    apart = max(float((e.grad - o.grad).norm() / e.grad.norm()) for e, o in pairs)
    return loss, reported, worst, apart


@pytest.mark.parametrize("per_token", [False, True])
def test_the_loss_and_its_gradient_are_megatrons_by_hand(per_token):
    """One process, 4 microbatches: the reported loss is the global batch's mean over the
    tokens whose input is not an EOD, and the gradient that of Megatron's normalisation; the
    two normalisations' gradients differ (so each test tells them apart)."""
    loss, reported, worst, apart = launch(_by_hand, 1, per_token, timeout=300)[0]
    assert loss == pytest.approx(reported, rel=1e-5)
    assert worst < 1e-5, worst
    assert apart > 1e-3


def _losses(nproc: int, **kw) -> list[float]:
    return launch(dw.losses, nproc, kw, timeout=300)[0]


@pytest.fixture(scope="module")
def straight():
    runs = {"all": dw.FLAGS, "positions": dw.POSITIONS}
    return {name: _losses(1, **flags) for name, flags in runs.items()}


LAYOUTS = {
    "tp2": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2": dict(pipeline_model_parallel_size=2, recompute_granularity="full"),
    "pp2-zb-h1": dict(pipeline_model_parallel_size=2, pipeline_schedule="zb-h1",
                      recompute_granularity="selective"),
    "dp2": dict(use_distributed_optimizer=True),
}  # fmt: skip


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_multi_rank_runs_with_the_flags_follow_the_one_process_curve(straight, layout):
    """Losses and gradient norms, with all three flags and with positions reset unmasked."""
    for name, flags in {"all": dw.FLAGS, "positions": dw.POSITIONS}.items():
        got = _losses(2, **flags, **LAYOUTS[layout])
        assert got == pytest.approx(straight[name], rel=REL, abs=0), name


def test_learned_positions_at_tp2_with_sequence_parallelism_follow_the_one_process_curve():
    """The learned table's rows of each sample's reset positions, each rank adding its slice."""
    kw = dict(dw.POSITIONS, position_embedding_type="learned_absolute")
    tp2 = dict(tensor_model_parallel_size=2, sequence_parallel=True)
    assert _losses(2, **kw, **tp2) == pytest.approx(_losses(1, **kw), rel=REL, abs=0)


@pytest.fixture(scope="module")
def plain():
    return _losses(1)


@pytest.mark.parametrize("flag", sorted(dw.FLAGS))
def test_each_flag_moves_the_curve_far_beyond_the_tolerance(plain, flag):
    """So that a layout that dropped one of them (on some stage or rank) would be caught."""
    moved = _losses(1, **{flag: True})[::2]  # the losses
    assert max(abs(a - b) / b for a, b in zip(moved, plain[::2], strict=True)) > 100 * REL


def test_per_token_loss_at_dp2_and_cp2_follows_the_one_process_curve():
    """--calculate-per-token-loss normalises over the whole global batch, across data and
    context parallel ranks; cp2 splits positions and loss masks as it splits tokens."""
    kw = dict(dw.POSITIONS, calculate_per_token_loss=True)
    one = _losses(1, **kw)
    default = _losses(1, **dw.POSITIONS)  # the other normalisation: another curve
    assert max(abs(a - b) / b for a, b in zip(one, default, strict=True)) > 100 * REL
    assert _losses(2, **kw) == pytest.approx(one, rel=REL, abs=0)
    assert _losses(2, context_parallel_size=2, **kw) == pytest.approx(one, rel=REL, abs=0)


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(eod_mask_loss=True), "the built-in corpus (Python sources as bytes"),
        (dict(reset_position_ids=True, mock_data=True), "--mock-data comes with no tokenizer"),
        (dict(reset_attention_mask=True, tokenizer_type="NullTokenizer", vocab_size=50,
              context_parallel_size=2), "--reset-attention-mask with --context-parallel-size 2"),
        (dict(reset_attention_mask=True, tokenizer_type="NullTokenizer", vocab_size=50,
              create_attention_mask_in_dataloader=False), "--no-create-attention-mask"),
    ],
)  # fmt: skip
def test_what_megart_does_not_do_is_refused_by_name(kw, says):
    with pytest.raises(ConfigError) as e:
        tw.tiny(**kw).check(2 if kw.get("context_parallel_size") else 1)
    assert says in str(e.value)


def test_the_eod_id_is_the_tokenizers(tmp_path):
    assert eod_token(tw.tiny(tokenizer_type="NullTokenizer", vocab_size=50)) == 50
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\n")
    for entries, want in (({"a": 0, "b": 1, "<|endoftext|>": 2}, 2), ({"a": 0, "b": 1}, None)):
        vocab.write_text(json.dumps(entries))
        c = tw.tiny(vocab_file=str(vocab), merge_file=str(merges), eod_mask_loss=True)
        if want is None:
            with pytest.raises(ConfigError, match="has no end-of-document token"):
                eod_token(c)
        else:
            assert eod_token(c) == want
