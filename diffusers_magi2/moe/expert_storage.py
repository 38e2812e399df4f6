"""How the routed experts' banks are stored: one :class:`ExpertStorage` object per format, a strategy the MoE layer
holds (vLLM's ``FusedMoEMethodBase``: ``create_weights``, ``process_weights_after_loading``, ``apply``).

The banks ``W_gate``/``W_up [R, Dh, De]`` and ``W_down [R, De, Dh]`` (``R = H*E`` flattened (head, expert) rows,
used as ``x @ W``) and their scales stay registered on the layer under the checkpoint names, so ``.to()``, group
offload, layerwise casting, ``state_dict`` and expert-parallel loading see plain tensors; the storage object says
what they are:

* creation: the stored shapes and dtypes of each bank and its scale (:meth:`ExpertStorage.create_banks`, meta
  included) and the random init (:meth:`ExpertStorage.init_banks`);
* quantization of a float bank ``[R, K, N]`` into ``(stored, scale)`` (:meth:`ExpertStorage.quantize`) and the load
  checks the loader and the converter run first (:meth:`ExpertStorage.check_bank`, :meth:`ExpertStorage.check_scale`:
  a wrong shape, a group size that does not divide ``K``, one error naming the tensor);
* the one place anything is dequantized: the expert matrices handed to a backend, per expert
  (:meth:`ExpertStorage.expert_matrices`) or per head's bank (:meth:`ExpertStorage.head_banks`);
* what a kernel needs: the rounding dtype of the hidden activation (:meth:`ExpertStorage.hidden_dtype`), the dtype
  of the fused kernel's weight tiles (:meth:`ExpertStorage.kernel_dtype`), whether it runs the stored banks with
  their per-channel scales (:attr:`ExpertStorage.scaled_kernel`) or one head's dequantized bank at a time
  (:attr:`ExpertStorage.per_head_kernel`), the GPUs it runs on (:meth:`ExpertStorage.check_capability`);
* the dtype-move rule (:attr:`ExpertStorage.keeps_dtype`: quantized banks and scales follow device moves only).

The formats are ``expert_storage_unquantized`` (bf16/fp16/fp32), ``expert_storage_fp8`` (e4m3, per-channel fp32
scales) and ``expert_storage_int4`` (NF4 codes, group scales); :mod:`.expert_formats` maps a config's
``expert_dtype`` or a raw weight tensor to one of them, and is the only code that asks a weight its dtype.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn


__all__ = ["BANKS", "SCALE_ARGS", "ExpertMatrices", "ExpertStorage", "bank_shapes", "check_kernel_device"]

#: the three expert banks, in the order every expert path takes them
BANKS = ("W_gate", "W_up", "W_down")
#: the scales' argument names in the expert paths (``scales=(w_gate_scale, w_up_scale, w_down_scale)``)
SCALE_ARGS = ("w_gate_scale", "w_up_scale", "w_down_scale")


def bank_shapes(rows: int, dh: int, de: int) -> tuple[tuple[int, int, int], ...]:
    """``[R, K, N]`` of ``W_gate``, ``W_up``, ``W_down``."""
    return (rows, dh, de), (rows, dh, de), (rows, de, dh)


def check_kernel_device(storage: "ExpertStorage", device: torch.device) -> None:
    """Raise ``ValueError`` if the fused kernel cannot run experts stored as ``storage`` on ``device`` (its
    :meth:`ExpertStorage.check_capability` for a CUDA device; the interpreter runs every format)."""
    device = torch.device(device)
    if device.type == "cuda":
        storage.check_capability(torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device))


def _describe(dtype: torch.dtype, shape) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


class _PerExpert(Sequence):
    """Row ``g`` of a bank as an fp32 ``[K, N]`` matrix, dequantized when read (``fn(row, scale_row)``)."""

    def __init__(self, bank: Tensor, scale: Optional[Tensor], fn) -> None:
        self.rows, self.fn = bank.unbind(0), fn  # tuple indexing in a loop costs no torch dispatch
        self.scales = (None,) * len(self.rows) if scale is None else scale.unbind(0)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, g: int) -> Tensor:
        return self.fn(self.rows[g], self.scales[g])


class ExpertMatrices(list):
    """The three banks as sequences of fp32 ``[K, N]`` matrices indexed by row ``g``
    (:meth:`ExpertStorage.expert_matrices`); :meth:`load_head` before reading a head's rows."""

    def load_head(self, experts: slice) -> None:
        """Prepare the rows ``experts`` (one head's) for reading; per-expert formats need nothing."""


class ExpertStorage:
    """One storage format of the routed experts (module docstring). Subclasses set the class attributes and
    :meth:`stored_layout`, :meth:`quantize`, :meth:`dequantize`; the rest follows.

    Attributes:
        expert_dtype: the config's ``expert_dtype`` for this format (``None``: the experts keep ``params_dtype``).
        scale_names: the scale buffers beside ``W_gate``/``W_up``/``W_down`` (``()``: none).
        keeps_dtype: the banks and scales keep their dtypes through dtype moves (quantized formats).
        scaled_kernel: the fused kernel reads the stored banks and applies ``scale[n]`` to its fp32 accumulators.
        per_head_kernel: the fused kernel runs one head's bank at a time, dequantized to the activation dtype.
    """

    expert_dtype: object = None
    scale_names: tuple[str, ...] = ()
    keeps_dtype = False
    scaled_kernel = False
    per_head_kernel = False
    #: the scale dtypes the expert paths accept
    kernel_scale_dtypes: tuple = ()
    #: for messages and configs: the config's name of this format, what the model's experts are, what a repo of
    #: them is, how a bank ``{name}`` of them is stored, and what else loading one takes
    config_name: Optional[str] = None
    label = "not"
    stored_label = ""
    repo_label = ""
    stored_as = ""
    load_hint = ""

    # ------------------------------------------------------------------ format (per subclass)

    def stored_layout(self, shape: tuple[int, int, int]) -> tuple[tuple, torch.dtype, Optional[tuple], object]:
        """``(bank shape, bank dtype, scale shape or None, scale dtype or None)`` of a bank ``[R, K, N]``."""
        raise NotImplementedError

    def quantize(
        self, bank: Tensor, *, name: str = "expert bank", first_row: int = 0, num_experts: Optional[int] = None
    ) -> tuple[Tensor, Optional[Tensor]]:
        """``(stored bank, scale or None)`` of a float bank ``[R, K, N]``.

        Raises:
            ValueError: a bank this format cannot hold (naming ``name``; a non-finite weight also names the expert,
                row and column, ``first_row`` being the bank row of ``bank[0]`` and ``num_experts`` the experts per
                head).
        """
        raise NotImplementedError

    def dequantize(self, bank: Tensor, scale: Optional[Tensor], *, out: Optional[Tensor] = None) -> Tensor:
        """fp32 values of stored rows ``[..., K, N']`` (``out``: a reused fp32 buffer, where the format writes one)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shapes and checks

    def logical_shape(self, stored_shape: Sequence[int]) -> tuple[int, ...]:
        """The ``[R, K, N]`` a stored bank holds (inverse of :meth:`stored_layout`'s bank shape)."""
        return tuple(stored_shape)

    def check_banks(self, head_dim: int, expert_dim: int, key: str = "group_size") -> None:
        """Refuse a layer of MoE head width ``Dh`` and expert width ``De`` this format cannot store (``key``: the
        setting that would have to change, for the message)."""

    def check_bank(self, name: str, shape: Sequence[int], expected: Sequence[int]) -> None:
        """Refuse a bank ``name`` of ``shape`` [R, K, N] (unquantized) where the layer holds ``expected``, or one this
        format cannot hold, before anything is written.

        Raises:
            ValueError: naming the tensor, its shape and the one expected.
        """
        if tuple(shape) != tuple(expected):
            raise ValueError(f"{name}: checkpoint shape {list(shape)}, the model expects {list(expected)}")

    def check_stored_bank(self, name: str, dtype: torch.dtype, shape: Sequence[int], expected: Sequence[int]) -> None:
        """Refuse a stored (already quantized) bank ``name`` that is not this format's bank of ``expected``."""
        bank_shape, bank_dtype, _, _ = self.stored_layout(tuple(expected))
        if (dtype, tuple(shape)) != (bank_dtype, tuple(bank_shape)):
            raise ValueError(
                f"{name}: checkpoint has {_describe(dtype, shape)}, the model expects {_describe(bank_dtype, bank_shape)}"
            )

    def check_scale(self, name: str, dtype: torch.dtype, shape: Sequence[int], expected: Sequence[int]) -> None:
        """Refuse a stored scale ``name`` that is not the scale of a bank of ``expected`` [R, K, N]."""
        _, _, scale_shape, scale_dtype = self.stored_layout(tuple(expected))
        if (dtype, tuple(shape)) != (scale_dtype, tuple(scale_shape)):
            raise ValueError(
                f"{name}: checkpoint has {_describe(dtype, shape)}, expected {_describe(scale_dtype, scale_shape)}"
            )

    def check_stored_checkpoint(self, name: str, scale_name: str, shape, full, infos) -> None:
        """Check a checkpoint bank ``name`` stored in this format, and its scale in ``infos`` (``{name: (dtype,
        shape)}``), against a layer bank of ``full [R, K, N]``.

        Raises:
            ValueError: naming the tensor, what the checkpoint has and what is expected.
        """

    def check_float_checkpoint(self, name: str, scale_name: str, dtype, shape, full, infos) -> None:
        """Check a float checkpoint bank ``name`` that loading quantizes into this format (no scale of its own may
        sit beside it).

        Raises:
            ValueError: naming the tensor.
        """
        self.check_bank(name, shape, full)
        if scale_name in infos:
            raise ValueError(f"{scale_name} is in the checkpoint but {name} is {dtype}, not {self.stored_label}")

    def refuse_source_dtype(self, name: str, scale_name: str, dtype) -> None:
        """Refuse a checkpoint bank in a dtype this format neither stores nor quantizes from."""
        raise ValueError(
            f"{name}: checkpoint dtype {dtype}; routed experts load from {self.stored_label} or a float dtype"
        )

    def config_entries(self) -> dict:
        """What a converted repo's ``config.json`` records for this format besides ``expert_dtype``."""
        return {}

    def describe_banks(self, count: int) -> str:
        """The converter's dry-run line for ``count`` banks written in this format."""
        return f"routed experts in {self.config_name}: {count} banks"

    def check_kernel_banks(self, weights: Sequence[Tensor], scales, head_dim: int) -> int:
        """Check ``w_down`` and the scales against ``w_gate`` (already checked: 3-D, ``[H*E, Dh, ...]``) for the
        expert paths; returns ``De``.

        Raises:
            ValueError: naming the tensor and the shape and dtype expected.
        """
        w_gate, _, w_down = weights
        flat, _, expert_dim = self.logical_shape(w_gate.shape)
        want = self.stored_layout((flat, expert_dim, head_dim))[0]
        if (
            tuple(w_down.shape) != tuple(want)
            or w_down.dtype != w_gate.dtype
            or self.logical_shape(want)[2] != head_dim
        ):
            raise ValueError(
                f"w_down must be [H*E={flat}, De={expert_dim}, {self._stored_dim('Dh', head_dim)}] with dtype "
                f"{w_gate.dtype}; got {tuple(w_down.shape)} {w_down.dtype}"
            )
        self.check_kernel_scales(weights, scales, head_dim, expert_dim)
        return expert_dim

    def _stored_dim(self, name: str, size: int) -> str:
        """How the last dim of a bank of ``size`` columns is stored, for messages (e.g. ``Dh=256``)."""
        return f"{name}={size}"

    def check_kernel_scales(self, weights: Sequence[Tensor], scales, head_dim: int, expert_dim: int) -> None:
        """Refuse ``scales`` that are not this format's three scales of ``weights`` (``None`` where it has none)."""
        if not self.scale_names:
            if scales is not None:
                raise ValueError(
                    f"scales are only used with float8_e4m3fn or int4 (uint8 codes) experts; the weights are "
                    f"{weights[0].dtype}"
                )
            return
        if scales is None:
            raise ValueError(f"{self} experts need scales=({', '.join(SCALE_ARGS)})")
        flat = weights[0].shape[0]
        for arg, scale, shape in zip(SCALE_ARGS, scales, bank_shapes(flat, head_dim, expert_dim)):
            scale_shape, allowed = self.stored_layout(shape)[2], self.kernel_scale_dtypes
            if tuple(scale.shape) != tuple(scale_shape) or scale.dtype not in allowed:
                names = "/".join(str(d).removeprefix("torch.") for d in allowed)
                raise ValueError(
                    f"{arg} must be a {names} tensor of shape {list(scale_shape)}; got {scale.dtype} "
                    f"{tuple(scale.shape)}"
                )
            if scale.device != weights[0].device:
                raise ValueError(f"{arg} is on {scale.device} but the weights are on {weights[0].device}")

    # ------------------------------------------------------------------ the layer's tensors

    def create_banks(self, module: nn.Module, rows: int, dh: int, de: int, device=None) -> None:
        """Register ``W_gate``/``W_up``/``W_down`` (parameters, frozen when quantized) and their scale buffers on
        ``module``, uninitialised (``device="meta"``: nothing allocated)."""
        names = self.scale_names or (None,) * 3
        for name, scale_name, shape in zip(BANKS, names, bank_shapes(rows, dh, de)):
            bank_shape, bank_dtype, scale_shape, scale_dtype = self.stored_layout(shape)
            bank = torch.empty(bank_shape, dtype=bank_dtype, device=device)
            setattr(module, name, nn.Parameter(bank, requires_grad=scale_name is None))
            if scale_name is not None:
                module.register_buffer(scale_name, torch.empty(scale_shape, dtype=scale_dtype, device=device))

    @torch.no_grad()
    def init_banks(self, module: nn.Module, real_rows: int, stds: Sequence[float], chunk: int = 64) -> None:
        """Normal init of ``module``'s banks (std per bank), zero past ``real_rows`` (padded heads); quantized
        formats draw in fp32 and quantize ``chunk`` experts at a time; meta banks only zero their scales (the
        loader fills both)."""
        names = self.scale_names or (None,) * 3
        for name, scale_name, std in zip(BANKS, names, stds):
            bank = getattr(module, name)
            if scale_name is None:
                bank.normal_(0.0, std)
                bank[real_rows:].zero_()
                continue
            scale = getattr(module, scale_name)
            if bank.is_meta:
                scale.zero_()
                continue
            k = bank.shape[1]
            n = self.logical_shape(bank.shape)[2]
            for start in range(0, bank.shape[0], chunk):
                block = torch.empty(bank[start : start + chunk].shape[0], k, n, device=bank.device).normal_(0.0, std)
                block[max(0, real_rows - start) :].zero_()
                bank[start : start + chunk], scale[start : start + chunk] = self.quantize(block)

    def layer_tensors(self) -> tuple[str, ...]:
        """The layer's tensors this storage owns: the banks and their scales."""
        return BANKS + self.scale_names

    # ------------------------------------------------------------------ what a backend reads

    def expert_matrices(self, weights: Sequence[Tensor], scales) -> ExpertMatrices:
        """The three banks as sequences of fp32 ``[K, N]`` matrices, one per row ``g``, each dequantized when read
        (never the whole bank); :meth:`load_head` first for formats that dequantize a head at a time."""
        scales = (None,) * 3 if scales is None else scales
        return ExpertMatrices(_PerExpert(w, s, self._expert) for w, s in zip(weights, scales))

    def _expert(self, row: Tensor, scale: Optional[Tensor]) -> Tensor:
        return self.dequantize(row, scale)

    def head_banks(
        self,
        weights: Sequence[Tensor],
        scales,
        experts: slice,
        dtype: torch.dtype,
        scratch: list,
        dequantize_into=None,
    ) -> list[Tensor]:
        """One head's three banks ``[E, K, N]`` (rows ``experts``) in ``dtype``. Formats that dequantize into a
        buffer keep three in ``scratch`` (a list of three, ``None`` at first) and write them with
        ``dequantize_into(stored, scale, out)`` when given (a device kernel), else their own torch code."""
        scales = (None,) * 3 if scales is None else scales
        return [
            self.dequantize(w[experts], None if s is None else s[experts]).to(dtype) for w, s in zip(weights, scales)
        ]

    def device_dequantizer(self):
        """The GPU kernel that writes stored rows into a buffer, ``(stored, scale, out) -> out`` (Triton on first
        use), for formats that dequantize a head into buffers; ``None`` for the others."""
        return None

    def hidden_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        """The dtype the swiglu7 output is rounded to before the down GEMM (:mod:`.reference`)."""
        return act_dtype

    def kernel_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the weight tiles the fused kernel loads."""
        return self.stored_layout((1, 1, 2))[1]

    def grad_dtype(self) -> torch.dtype:
        """The dtype of a bank's gradient (quantized banks: fp32)."""
        return torch.float32

    def check_capability(self, capability: Optional[tuple[int, int]], name: str = "this GPU") -> None:
        """Refuse a CUDA ``capability`` the fused kernel cannot run this format on (``None``: the interpreter)."""

    def describe(self) -> str:
        """This format in the layer's ``repr`` (``""`` for unquantized experts)."""
        return ""
