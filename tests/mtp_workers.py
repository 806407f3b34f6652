"""Multi-token prediction against Megatron-Core 0.16.1's own (its GPTModel with mtp_num_layers and
the local MTP block spec, CPU, float64): the same weights (names mapped by
megart.models.megatron_names), the same loss, depth losses and gradients. Run in a launched
process, since Megatron-Core keeps its parallel state in module globals."""

from __future__ import annotations

import torch

import megatron_core_workers as mcw
from megart.models import GPT, GPTConfig
from megart.models.megatron_names import to_megatron


def compare_mtp(kw: dict, mask_eod: int | None = None) -> dict:
    """megart's GPT of ``kw`` (weights drawn with noise) and Megatron-Core's GPTModel loading
    its weights: the largest differences of the main loss, each depth's loss (Megatron-Core's
    MTPLossLoggingHelper tracker) and every parameter's gradient; with experts, each layer's
    auxiliary losses on both sides (``aux``, ``their_aux``: Megatron-Core's MoE tracker, the
    depths' layers after the decoder's). ``mask_eod``: a token whose positions the loss mask
    leaves out (as --eod-mask-loss does)."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    cfg = GPTConfig(**kw)
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    tokens, labels = data[:, :-1], data[:, 1:]
    loss_mask = None if mask_eod is None else (tokens != mask_eod).double()

    ours = mcw.drawn(GPT(cfg).double())
    if loss_mask is None:
        loss = ours(tokens, labels)
    else:
        token_losses = ours.chunk.token_losses(ours.chunk(tokens), labels, loss_mask)
        loss = (token_losses * loss_mask.t()).sum() / loss_mask.sum()
    loss.backward()
    ours_tracked = ours.chunk.aux_loss_scale.take()
    tracked = ours_tracked.pop("mtp")
    depth_losses = torch.stack([tracked[k] for k in range(cfg.mtp_num_layers)])

    theirs = mcw.megatron_model(cfg)
    mapped = to_megatron(ours.state_dict(), cfg)
    # Its own: the layers' extra state, the routers' expert biases (zero on both sides).
    own = ("_extra_state", "router.expert_bias")
    extra = {k: v for k, v in theirs.state_dict().items() if k.endswith(own)}
    theirs.load_state_dict({**mapped, **extra}, strict=True)
    theirs.train()
    positions = torch.arange(cfg.seq_length).unsqueeze(0).expand_as(tokens)
    causal = torch.ones(1, 1, cfg.seq_length, cfg.seq_length, dtype=torch.bool).triu(1)
    MTPLossLoggingHelper.tracker.clear()
    # Emptied, not zeroed (clear_aux_losses_tracker): it keeps an earlier model's layer count.
    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    per_token = theirs(tokens, positions, causal, labels=labels, loss_mask=loss_mask)  # [b, s]
    if loss_mask is None:
        their_loss = per_token.mean()
    else:
        their_loss = (per_token * loss_mask).sum() / loss_mask.sum()
    their_loss.backward()
    their_depths = MTPLossLoggingHelper.tracker["values"]
    # The MoE layers' auxiliary losses, by name and layer (the depths' after the decoder's).
    layers = cfg.num_layers + cfg.mtp_num_layers
    aux = {name: torch.zeros(layers, dtype=torch.float64) for name in ours_tracked}
    for name, by_layer in ours_tracked.items():
        for layer, value in by_layer.items():
            aux[name][layer] = value
    their_aux = {
        k: v["values"].double() for k, v in moe_utils.get_moe_layer_wise_logging_tracker().items()
    }

    our_grads = to_megatron({n: p.grad for n, p in ours.named_parameters()}, cfg)
    their_grads = {n: p.grad for n, p in theirs.named_parameters()}
    assert set(our_grads) == set(their_grads), set(our_grads) ^ set(their_grads)
    grad = max((our_grads[n] - their_grads[n]).abs().max().item() for n in their_grads)
    # The last depth's router (MoE depths only): its weight learns from the depth's losses.
    router = our_grads.get(
        f"mtp.layers.{cfg.mtp_num_layers - 1}.transformer_layer.mlp.router.weight"
    )
    return dict(
        loss=abs(loss.item() - their_loss.item()),
        depths=(depth_losses - their_depths).abs().max().item(),
        grad=grad,
        depth_values=depth_losses.tolist(),
        aux={name: aux[name].tolist() for name in aux},
        their_aux={name: v.tolist() for name, v in their_aux.items()},
        mtp_grad=our_grads["mtp.layers.0.eh_proj.weight"].abs().max().item(),
        router_grad=0.0 if router is None else router.abs().max().item(),
    )


def compare_all(configs: list[dict], mask_eod: int | None = None) -> list[dict]:
    return [compare_mtp(kw, mask_eod) for kw in configs]


def document_curve(kw: dict) -> list[float]:
    """The loss, gradient norm and depth losses of each iteration of a document-flag run
    (tests/document_workers.py: end-of-document tokens about one in eight) with ``kw``."""
    import document_workers as dw

    history = dw.trainer(**kw).train(quiet=True)
    keys = ("loss", "grad_norm", *(k for k in history[0] if k.startswith("mtp_")))
    return [h[k] for h in history for k in keys]


def curve(history: list[dict], names: tuple[str, ...]) -> list[float]:
    """Figures ``names`` of every iteration of ``history``, iteration by iteration."""
    return [h[name] for h in history for name in names]


def one_process_histories(runs: dict[str, dict]) -> dict[str, list[dict]]:
    """The history of one launched process (one intra-op thread) training each of ``runs``
    (name: megart train flags), by name."""
    import train_workers as tw
    from megart.launcher import launch

    return {
        name: launch(tw.train_kw, 1, kw, timeout=300, env=tw.ONE_THREAD)[0]
        for name, kw in runs.items()
    }
