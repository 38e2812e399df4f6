"""Input and output adapters of both MAGI-2 transformers (SandAI ``PreAdapter`` / ``PostAdapter``).

Numerically follow SandAI-org/MAGI-2-preview ``inference/model/magi2_preview.py`` (reference spec
§1.2, §1.10). Both are fp32 islands (``_keep_in_fp32_modules``): the pre adapter embeds each packed
token with its modality's linear layer to the residual width (``n*C`` in the Preview, ``C`` in the
Refiner) and builds the rope table;
the post adapter projects the final residual back to video / audio latent channels.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .embeddings_magi2 import Magi2RotaryPosEmbed
from .modality import Magi2MultiModalityRMSNorm, Modality

__all__ = ["Magi2PreAdapter", "Magi2PostAdapter"]


class Magi2PreAdapter(nn.Module):
    """Input adapters (SandAI ``PreAdapter``; spec §1.2) and the rope table.

    fp32 ``nn.Linear`` with bias per modality, each to the multi-stream width ``n*C``; a token uses
    the first ``C_in`` channels of its own modality. Returns ``([N, n*C] fp32, rope [N, 6*Dh/8] fp32)``.
    """

    def __init__(self, width: int, head_dim: int, video_in: int, audio_in: int, text_in: int) -> None:
        super().__init__()
        self.video_in, self.audio_in, self.text_in = video_in, audio_in, text_in
        self.width = width
        self.video_embedder = nn.Linear(video_in, width, bias=True, dtype=torch.float32)
        self.text_embedder = nn.Linear(text_in, width, bias=True, dtype=torch.float32)
        self.audio_embedder = nn.Linear(audio_in, width, bias=True, dtype=torch.float32)
        self.rope = Magi2RotaryPosEmbed(head_dim)

    def forward(self, hidden_states: torch.Tensor, coords: torch.Tensor, modality_ids: torch.Tensor):
        """Embed packed tokens per modality and build their rope table (matches SandAI ``PreAdapter.forward``).

        Args:
            hidden_states: ``[N, C_max]`` packed tokens (any float dtype; cast to fp32), each zero-padded
                on channels; a token of modality m uses its first ``C_m`` channels (video ``Cv``,
                audio ``Ca``, text ``Ct``), so ``C_max`` must cover every modality present.
            coords: ``[N, 9]`` rope coordinates ``(t, h, w, T, H, W, refT, refH, refW)``.
            modality_ids: ``[N]`` integer :class:`Modality` ids (video 0, audio 1, text 2); tokens of
                other ids get zero embeddings.

        Returns:
            ``(embedded [N, n*C] fp32, rope [N, 6*Dh/8] fp32)``, both in packed order.

        Raises:
            RuntimeError: ``C_max`` is narrower than a present modality's input width (the caller,
                :meth:`Magi2Transformer3DModel.forward_packed`, raises ``ValueError`` first).
        """
        x = hidden_states.float()
        out = x.new_zeros(x.shape[0], self.width)
        for mod in (Modality.TEXT, Modality.AUDIO, Modality.VIDEO):
            idx = (modality_ids == int(mod)).nonzero().flatten()
            if idx.numel() > 0:
                out.index_copy_(0, idx, self.embed(mod, x.index_select(0, idx)))
        return out, self.rope(coords)

    def embed(self, modality: Modality, tokens: torch.Tensor) -> torch.Tensor:
        """``[n, >= C_in]`` tokens of one modality (their first ``C_in`` channels) -> ``[n, width]`` fp32."""
        emb, cin = {
            Modality.VIDEO: (self.video_embedder, self.video_in),
            Modality.AUDIO: (self.audio_embedder, self.audio_in),
            Modality.TEXT: (self.text_embedder, self.text_in),
        }[Modality(modality)]
        return emb(tokens.float()[:, :cin].to(emb.weight.dtype)).float()


class Magi2PostAdapter(nn.Module):
    """Output heads (SandAI ``PostAdapter``; spec §1.10): per-modality RMSNorm over ``n*C`` + fp32 linear.

    Returns ``[N, max(Cv, Ca)]`` fp32; video rows use ``[:Cv]``, audio rows ``[:Ca]``, others are 0.
    """

    def __init__(self, width: int, video_in: int, audio_in: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.video_in, self.audio_in = video_in, audio_in
        self.final_norm_video = Magi2MultiModalityRMSNorm(width, 1, eps=eps)
        self.final_norm_audio = Magi2MultiModalityRMSNorm(width, 1, eps=eps)
        self.final_linear_video = nn.Linear(width, video_in, bias=False, dtype=torch.float32)
        self.final_linear_audio = nn.Linear(width, audio_in, bias=False, dtype=torch.float32)

    def forward(self, hidden_states: torch.Tensor, modality_ids: torch.Tensor) -> torch.Tensor:
        """Project the residual streams back to latent channels (matches SandAI ``PostAdapter.forward``).

        Args:
            hidden_states: ``[N, n*C]`` final residual (any float dtype), packed order.
            modality_ids: ``[N]`` integer :class:`Modality` ids.

        Returns:
            ``[N, max(Cv, Ca)]`` fp32: video rows hold ``final_linear_video(final_norm_video(x))`` in
            ``[:Cv]``, audio rows the audio head in ``[:Ca]``; text and other rows are zero.

        Raises:
            ValueError: last dim of ``hidden_states`` is not ``n*C`` (from the RMSNorm).
        """
        out = hidden_states.new_zeros(hidden_states.shape[0], max(self.video_in, self.audio_in), dtype=torch.float32)
        for mod, norm, lin, cout in (
            (Modality.VIDEO, self.final_norm_video, self.final_linear_video, self.video_in),
            (Modality.AUDIO, self.final_norm_audio, self.final_linear_audio, self.audio_in),
        ):
            idx = (modality_ids == int(mod)).nonzero().flatten()
            if idx.numel() > 0:
                y = lin(norm(hidden_states.index_select(0, idx).float()).to(lin.weight.dtype)).float()
                out[:, :cout].index_copy_(0, idx, y)
        return out
