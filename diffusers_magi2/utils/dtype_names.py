"""The dtype names ``magi2-convert`` takes (``--dtype``, ``--expert_dtype``, ``--dense_storage_dtype``), in a module without torch so that the
command line checks its flags before torch is imported; :mod:`.dtype_utils` turns names into ``torch.dtype``."""

from __future__ import annotations


__all__ = ["DENSE_STORAGE_DTYPE_CHOICES", "DTYPE_CHOICES", "EXPERT_DTYPE_CHOICES"]

#: ``magi2-convert --dtype`` choices: ``keep`` the stored dtypes, or cast to bf16 / fp32 (fp32 islands stay fp32).
DTYPE_CHOICES = ("keep", "bf16", "fp32")
#: ``magi2-convert --expert_dtype`` choices -> the model's ``expert_dtype`` (FP8 e4m3 routed experts + fp32 scales, or
#: int4: NF4 codes + bf16 group scales).
EXPERT_DTYPE_CHOICES = {"fp8_e4m3": "float8_e4m3fn", "int4": "int4"}
#: ``magi2-convert --dense_storage_dtype`` choices -> the models' ``dense_storage_dtype`` (the dense projections in
#: FP8 e4m3 with fp32 scales per output channel).
DENSE_STORAGE_DTYPE_CHOICES = {"fp8_e4m3": "float8_e4m3fn"}
