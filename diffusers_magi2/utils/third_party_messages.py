"""Two third-party messages that cannot apply to a MAGI-2 run, kept from showing where they cannot apply.

* transformers' notice that Qwen3.5's linear-attention layers fall back to PyTorch because ``causal_conv1d`` or
  ``flash-linear-attention`` is not installed (logger ``transformers.integrations.hub_kernels``, printed on the first
  text-encoder forward). Both packages are CUDA kernels, so on a machine where torch sees no CUDA device the advice
  cannot be followed: :class:`CudaKernelAdviceFilter` drops exactly those records there. With CUDA it still shows.
* torch's ``FutureWarning`` that ``torch.nn.utils.weight_norm`` is deprecated, raised while diffusers'
  ``AutoencoderOobleck`` builds its convolutions (diffusers' code, not the caller's): ignored for that message from
  that module only.

:func:`install_third_party_message_filters` is called once when ``diffusers_magi2`` is imported; calling it again
adds nothing.
"""

from __future__ import annotations

import logging
import warnings


__all__ = ["CudaKernelAdviceFilter", "install_third_party_message_filters"]

HUB_KERNELS_LOGGER = "transformers.integrations.hub_kernels"
_FALLBACK = "is falling back to its reference PyTorch implementation"
_CUDA_ONLY_PACKAGES = ("`causal_conv1d`", "`flash-linear-attention`")
WEIGHT_NORM_MESSAGE = r"`torch\.nn\.utils\.weight_norm` is deprecated"
WEIGHT_NORM_MODULE = r"torch\.nn\.utils\.weight_norm"


class CudaKernelAdviceFilter(logging.Filter):
    """Drops transformers' "install ``causal_conv1d`` / ``flash-linear-attention``" notice when torch sees no CUDA."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if _FALLBACK not in message or not any(p in message for p in _CUDA_ONLY_PACKAGES):
            return True
        import torch

        return torch.cuda.is_available()


def install_third_party_message_filters() -> None:
    """Install the two filters of the module docstring (idempotent)."""
    logger = logging.getLogger(HUB_KERNELS_LOGGER)
    if not any(isinstance(f, CudaKernelAdviceFilter) for f in logger.filters):
        logger.addFilter(CudaKernelAdviceFilter())
    warnings.filterwarnings("ignore", message=WEIGHT_NORM_MESSAGE, category=FutureWarning, module=WEIGHT_NORM_MODULE)
