"""Class-label "text encoder" for the bundled class-conditional models.

Flux-style transformers are conditioned on a token sequence (`encoder_hidden_states`, joint attention) and on a
pooled vector (`pooled_projections`, added to the timestep embedding that drives AdaLN). For a class-conditional
model both come from learned lookup tables indexed by the label:

    label l in {0..9}, or l = 10 (the null label, used for the unconditional branch of classifier-free guidance)
    encoder_hidden_states[b] = tokens[l_b].view(num_tokens, joint_attention_dim)      # [B, T, D_joint]
    pooled_projections[b]    = pooled[l_b]                                            # [B, D_pooled]

Families without a pooled vector (Wan) use pooled_projection_dim=0: no pooled table, and None in its place.
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn


class LabelEncoder(ModelMixin, ConfigMixin):
    """Maps labels [B] (int64, 0..num_classes; num_classes is the null label) to a DiT's conditioning tensors."""

    @register_to_config
    def __init__(
        self,
        num_classes: int = 10,
        num_tokens: int = 4,
        joint_attention_dim: int = 64,
        pooled_projection_dim: int = 64,
    ):
        super().__init__()
        # One extra row per table for the null label (index num_classes). N(0, 1) init, like nn.Embedding.
        self.token_table = nn.Embedding(num_classes + 1, num_tokens * joint_attention_dim)
        self.pooled_table = nn.Embedding(num_classes + 1, pooled_projection_dim) if pooled_projection_dim else None

    @property
    def null_label(self) -> int:
        """The label that means "no class": the unconditional branch of classifier-free guidance."""
        return self.config.num_classes

    def forward(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """labels [B] int64 -> (encoder_hidden_states [B, T, D_joint], pooled_projections [B, D_pooled] or None)."""
        if labels.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"LabelEncoder expects integer labels, got dtype {labels.dtype}; "
                f"pass torch.tensor(labels, dtype=torch.long)."
            )
        tokens = self.token_table(labels)  # [B, T * D_joint]
        tokens = tokens.view(labels.shape[0], self.config.num_tokens, self.config.joint_attention_dim)
        return tokens, None if self.pooled_table is None else self.pooled_table(labels)
