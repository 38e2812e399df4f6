"""Input and output adapters of both MAGI-2 models (SandAI ``PreAdapter`` / ``PostAdapter``), fp32 islands.

The pre adapter embeds each token with its modality's linear to the residual width and builds the rope table;
the post adapter maps the final residual back to video and audio latent channels through a per-modality
RMSNorm and linear. Both work in token chunks when ``chunk_size`` is set (bounding their fp32 temporaries).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .embeddings_magi2 import Magi2RotaryPosEmbed
from .modality import Magi2ModalityDispatch, Magi2MultiModalityRMSNorm, Modality


__all__ = ["Magi2PreAdapter", "Magi2PostAdapter"]


class Magi2PreAdapter(nn.Module):
    """Input adapters (SandAI ``PreAdapter``): an fp32 linear with bias per modality, and the rope table."""

    def __init__(self, width: int, head_dim: int, video_in: int, audio_in: int, text_in: int) -> None:
        super().__init__()
        self.video_in, self.audio_in, self.text_in = video_in, audio_in, text_in
        self.width = width
        self.video_embedder = nn.Linear(video_in, width, bias=True, dtype=torch.float32)
        self.text_embedder = nn.Linear(text_in, width, bias=True, dtype=torch.float32)
        self.audio_embedder = nn.Linear(audio_in, width, bias=True, dtype=torch.float32)
        self.rope = Magi2RotaryPosEmbed(head_dim)
        self.chunk_size = None  # tokens per embedding chunk (the model's enable_forward_chunking)

    def forward(self, hidden_states: torch.Tensor, coords: torch.Tensor, dispatch: Magi2ModalityDispatch):
        """Embed packed tokens per modality and build their rope table.

        Args:
            hidden_states: ``[N, C_max]`` packed tokens; a token of modality ``m`` uses its first ``C_m`` channels.
            coords: ``[N, 9]`` rope coordinates.
            dispatch: the tokens' :class:`Magi2ModalityDispatch` (where each modality's tokens are).

        Returns:
            ``(embedded [N, width] fp32, rope [N, 6*Dh/8] fp32)``, packed order.
        """
        x = hidden_states.float()
        out = x.new_zeros(x.shape[0], self.width)
        for mod in (Modality.TEXT, Modality.AUDIO, Modality.VIDEO):
            idx = dispatch.token_indices(mod)
            for part in _chunks(idx, self.chunk_size):
                out.index_copy_(0, part, self.embed(mod, x.index_select(0, part)))
        return out, self.rope(coords)

    def embed(self, modality: Modality, tokens: torch.Tensor) -> torch.Tensor:
        """``[n, >= C_in]`` tokens of one modality -> ``[n, width]`` fp32."""
        emb, cin = {
            Modality.VIDEO: (self.video_embedder, self.video_in),
            Modality.AUDIO: (self.audio_embedder, self.audio_in),
            Modality.TEXT: (self.text_embedder, self.text_in),
        }[Modality(modality)]
        return emb(tokens.float()[:, :cin].to(emb.weight.dtype)).float()


class Magi2PostAdapter(nn.Module):
    """Output heads (SandAI ``PostAdapter``): per-modality RMSNorm and fp32 linear."""

    def __init__(self, width: int, video_in: int, audio_in: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.video_in, self.audio_in = video_in, audio_in
        self.final_norm_video = Magi2MultiModalityRMSNorm(width, 1, eps=eps)
        self.final_norm_audio = Magi2MultiModalityRMSNorm(width, 1, eps=eps)
        self.final_linear_video = nn.Linear(width, video_in, bias=False, dtype=torch.float32)
        self.final_linear_audio = nn.Linear(width, audio_in, bias=False, dtype=torch.float32)
        self.chunk_size = None  # tokens per chunk of the fp32 norm (the model's enable_forward_chunking)

    def forward(self, hidden_states: torch.Tensor, dispatch: Magi2ModalityDispatch) -> torch.Tensor:
        """``[N, width]`` final residual (packed order; ``dispatch`` says where each modality's tokens are) ->
        ``[N, max(Cv, Ca)]`` fp32: video rows in ``[:Cv]``, audio rows in ``[:Ca]``, other rows zero.

        Raises:
            ValueError: the last dim is not ``width``.
        """
        out = hidden_states.new_zeros(hidden_states.shape[0], max(self.video_in, self.audio_in), dtype=torch.float32)
        for mod, norm, lin, cout in (
            (Modality.VIDEO, self.final_norm_video, self.final_linear_video, self.video_in),
            (Modality.AUDIO, self.final_norm_audio, self.final_linear_audio, self.audio_in),
        ):
            idx = dispatch.token_indices(mod)
            for part in _chunks(idx, self.chunk_size):
                y = lin(norm(hidden_states.index_select(0, part).float()).to(lin.weight.dtype)).float()
                out[:, :cout].index_copy_(0, part, y)
        return out


def _chunks(idx: torch.Tensor, chunk_size):
    """``idx`` in pieces of at most ``chunk_size`` (all of it when ``None``); nothing when empty."""
    if idx.numel() == 0:
        return ()
    if chunk_size is None:
        return (idx,)
    return idx.split(chunk_size)
