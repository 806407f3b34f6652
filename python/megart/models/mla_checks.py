"""GPTConfig's multi-latent attention fields (Megatron's --multi-latent-attention, --q-lora-rank,
--kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim): their checks, the layouts
they split over and the flags that name them, kept apart from the config itself, which calls
them. The layer is megart.models.mla's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megart.errors import ConfigError
from megart.parallel.layout import divisors, either

if TYPE_CHECKING:
    from megart.models.config import GPTConfig

# The MLA fields' defaults (Megatron-LM's flags'): a model without MLA must leave them so, as
# anything else would be ignored.
MLA_DEFAULTS: dict[str, object] = {
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128,
}
_FLAGS = {name: "--" + name.replace("_", "-") for name in MLA_DEFAULTS}


def check_mla(cfg: GPTConfig) -> None:
    """Refuses MLA fields that cannot build a layer, and MLA with what megart's layer (or
    Megatron-Core's) does not combine it with, naming the flags."""
    if not cfg.multi_latent_attention:
        given = [f"{_FLAGS[n]} {getattr(cfg, n)}" for n, d in MLA_DEFAULTS.items()
                 if getattr(cfg, n) != d]  # fmt: skip
        if given:
            raise ConfigError(
                f"{', '.join(given)}: multi-latent attention's sizes; add "
                "--multi-latent-attention or leave them out (Megatron ignores them without it)"
            )
        return
    small = [f"{_FLAGS[n]} {getattr(cfg, n)}" for n in MLA_DEFAULTS
             if getattr(cfg, n) is not None and getattr(cfg, n) < 1]  # fmt: skip
    if small:
        raise ConfigError(f"{', '.join(small)}: multi-latent attention's sizes are at least 1")
    if cfg.qk_pos_emb_head_dim % 2:
        raise ConfigError(
            f"--qk-pos-emb-head-dim {cfg.qk_pos_emb_head_dim}: rope turns those channels in "
            "pairs, so it must be even"
        )
    refused = {
        # Megatron-LM's MLA takes its rope (plain or YaRN) from --rope-type.
        "--position-embedding-type rope": cfg.position_embedding != "rotary",
        "no --group-query-attention": cfg.num_query_groups is not None,
        "no --kv-channels (MLA's heads are --qk-head-dim, --qk-pos-emb-head-dim and "
        "--v-head-dim wide)": cfg.kv_channels is not None,
        "no --rotary-percent (MLA turns all --qk-pos-emb-head-dim channels)": cfg.rotary_percent
        != 1,
        # Megatron-Core refuses it with MLA (its MLA turns DeepSeek's adjacent pairs).
        "no --rotary-interleaved": cfg.rotary_interleaved,
        # Megatron-Core's MLA builds its rope without them: it would ignore them.
        "no --use-rope-scaling": cfg.rope_scaling,
        "no --rotary-seq-len-interpolation-factor": cfg.rotary_seq_len_interpolation_factor
        is not None,
        "no --window-size (megart's MLA attends causally over the whole sequence)": (
            cfg.window_size is not None
        ),
    }
    wanted = [flag for flag, bad in refused.items() if bad]
    if wanted:
        raise ConfigError(f"--multi-latent-attention needs {'; '.join(wanted)}")


def mla_layout_problems(cfg: GPTConfig, tp: int) -> list[str]:
    """Why tensor-parallel size ``tp`` cannot split the MLA projections: the heads (checked
    with the query groups), and the column-parallel down-projections' rows (Megatron-Core's
    local spec splits them too, and gathers their outputs)."""
    if not cfg.multi_latent_attention:
        return []
    rows = {"--kv-lora-rank + --qk-pos-emb-head-dim": cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim}
    if cfg.q_lora_rank is not None:
        rows["--q-lora-rank"] = cfg.q_lora_rank
    return [
        f"the down-projection's {n} rows ({what}) do not split over tensor-parallel size {tp} "
        f"(use tensor-parallel size {either(divisors(n))})"
        for what, n in rows.items()
        if n % tp
    ]


def mla_flags(cfg: GPTConfig) -> str:
    """The megart train flags that give ``cfg``'s attention's MLA shape (for
    config_flags.architecture_flags)."""
    if not cfg.multi_latent_attention:
        return "no --multi-latent-attention"
    return f"--multi-latent-attention --rope-type {cfg.rope_type} " + " ".join(
        f"{_FLAGS[n]} {getattr(cfg, n)}" for n in MLA_DEFAULTS if getattr(cfg, n) is not None
    )


def refuse_mla(cfg: GPTConfig, what: str) -> None:
    """Refuses a model with multi-latent attention for ``what`` (a checkpoint format, an
    exporter) that megart has not built MLA's weights for."""
    if cfg.multi_latent_attention:
        raise ConfigError(
            f"{what}: megart does not write or read multi-latent attention "
            "(--multi-latent-attention) there; its own checkpoint format and Megatron-LM's "
            "(--ckpt-format megart, torch, torch_dist) hold MLA's weights"
        )
