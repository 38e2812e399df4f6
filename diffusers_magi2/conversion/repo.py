"""Repository-level conversion: SandAI release -> diffusers pipeline folder (``magi2-convert``).

:func:`convert_checkpoint` checks the request, validates every component from headers (all problems raised
together, nothing written), then writes into a sibling temporary folder renamed to ``OUT`` at the end (removed
on failure; an existing ``OUT`` is replaced only with ``overwrite``). The result is a diffusers pipeline repo:
``model_index.json``, one folder per component, ``README.md`` from ``model_card.md``, and the Modular Diffusers
files (:mod:`~diffusers_magi2.pipelines.modular_files`).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from ..loaders.key_plan import CheckpointValidationError
from ..pipelines.modular_files import write_modular_files
from ..pipelines.tiny_default import FP32_COMPONENTS
from ..utils.dtype_utils import EXPERT_DTYPE_CHOICES
from . import components
from .convert_transformer import PreparedTransformer, prepare_transformer_conversion, write_transformer
from .dense_fp8 import store_dense_weights_fp8
from .model_card import COMPONENTS, components_table, model_summary, render_model_card
from .release_layout import ALL_COMPONENTS, RELEASE_LAYOUT
from .request import ConversionRequest, ConversionRequestError, request_problems
from .sandai_prompt_enhancer import write_sandai_prompt_enhancer


__all__ = [
    "ALL_COMPONENTS",
    "MODEL_INDEX_ENTRIES",
    "RELEASE_LAYOUT",
    "ConversionRequest",
    "ConversionRequestError",
    "ConversionValidationError",
    "convert_checkpoint",
    "default_scheduler",
    "model_index_dict",
    "push_folder_to_hub",
]

TRANSFORMER_COMPONENTS = ("transformer", "refiner")

#: model_index.json entries: component -> (library or defining module, class).
MODEL_INDEX_ENTRIES: dict[str, tuple[str, str]] = {name: (lib, cls) for name, (lib, cls, _) in COMPONENTS.items()}
PIPELINE_ENTRY = ("diffusers_magi2.pipelines.pipeline_magi2", "Magi2Pipeline")

#: component -> name of its conversion function in ``diffusers_magi2.conversion.components``.
COMPONENT_FUNCTIONS = {
    "vae": "convert_wan22_vae",
    "video_decoder": "convert_turbo_vae",
    "audio_vae": "convert_stable_audio_vae",
    "text_encoder": "convert_text_encoder",
}


class ConversionValidationError(ValueError):
    """What is wrong with the inputs of each component, found before anything was written.

    ``str(err)`` summarises each component; ``report(verbose=True)`` lists every problem.

    Attributes:
        errors: component -> its error (a :class:`~.key_plan.CheckpointValidationError` for a transformer).
    """

    def __init__(self, errors: dict[str, ValueError]):
        self.errors = dict(errors)
        super().__init__(self.report())

    def report(self, verbose: bool = False) -> str:
        """One block per component: the summary, or with ``verbose`` every problem."""
        return "\n".join(
            f"[{comp}] {err.report(verbose) if isinstance(err, CheckpointValidationError) else err}"
            for comp, err in self.errors.items()
        )


def default_scheduler():
    """The ``UniPCMultistepScheduler`` that reproduces SandAI's Flow-UniPC (``Magi2PreviewSampler``), shift 7."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(
        num_train_timesteps=1000,
        solver_order=2,
        solver_type="bh2",
        predict_x0=True,
        lower_order_final=True,
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=7.0,
        final_sigmas_type="zero",
    )


#: ``Magi2Pipeline`` config keys of the refiner stage -> their entry in ``refiner_sampling_from_sandai``.
REFINER_SETTINGS = {
    "refiner_num_inference_steps": "num_inference_steps",
    "refiner_shift": "shift",
    "refiner_guidance_scale": "guidance_scale",
    "refiner_noise_value": "noise_value",
}


def refiner_settings(config: Path | None) -> dict:
    """The pipeline's refiner-stage settings from SandAI's refiner JSON ``evaluation_config`` (``None``: released).

    Raises:
        ValueError: the JSON does not describe the refiner.
    """
    from ..loaders.original_checkpoint import original_format
    from ..loaders.sandai_config_refiner import refiner_sampling_from_sandai
    from ..models.transformer_magi2_refiner import Magi2RefinerTransformer3DModel

    cfg, _ = original_format(Magi2RefinerTransformer3DModel).resolve_config(config)
    sampling = refiner_sampling_from_sandai(cfg)
    return {key: sampling[name] for key, name in REFINER_SETTINGS.items()}


def model_index_dict(written: dict[str, tuple[str, str]], settings: dict | None = None) -> dict:
    """``model_index.json`` content: every pipeline component, ``[null, null]`` for those not converted, then the
    pipeline ``settings`` (e.g. :func:`refiner_settings`), which ``Magi2Pipeline.from_pretrained`` reads as config."""
    import diffusers

    index: dict[str, object] = {"_class_name": PIPELINE_ENTRY[1], "_diffusers_version": diffusers.__version__}
    for name in sorted(MODEL_INDEX_ENTRIES):
        index[name] = list(written[name]) if name in written else [None, None]
    index.update(settings or {})
    return index


def _tokenizer_class(folder: Path) -> str:
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        cls = json.loads(cfg.read_text()).get("tokenizer_class")
        if cls:
            return str(cls)
    return MODEL_INDEX_ENTRIES["tokenizer"][1]


def _check_request(req: ConversionRequest) -> None:
    problems = request_problems(req)
    if problems:
        raise ConversionRequestError(problems)


def convert_checkpoint(req: ConversionRequest, log: Callable[[str], None] = print) -> Path | None:
    """Convert a SandAI MAGI-2 release (or parts of it) into a diffusers pipeline repository.

    Returns:
        the output folder, or ``None`` for a dry run.

    Raises:
        ValueError: a bad request (:class:`~.request.ConversionRequestError`, every problem listed), or
            :class:`ConversionValidationError` with every checkpoint problem, before anything is written; a converter's error propagates after the temporary folder is removed.
    """
    _check_request(req)
    out = Path(req.output_path).absolute()

    # 1. Plan every transformer-like component from headers, and check the Stable Audio encoder choice
    # from its config; collect every problem.
    prepared: dict[str, PreparedTransformer] = {}
    failures: dict[str, ValueError] = {}
    for comp in TRANSFORMER_COMPONENTS:
        if comp not in req.components:
            continue
        try:
            prepared[comp] = prepare_transformer_conversion(
                comp,
                req.inputs[comp],
                req.config,
                dtype=req.dtype,
                max_shard_size=req.max_shard_size,
                check_data=not req.dry_run,
                expert_dtype=EXPERT_DTYPE_CHOICES.get(req.expert_dtype) if comp == "transformer" else None,
                **({"expert_int4_group_size": req.expert_int4_group_size} if req.expert_int4_group_size else {}),
            )
        except CheckpointValidationError as err:
            failures[comp] = err
    if "audio_vae" in req.components:
        try:
            components.check_stable_audio_vae(req.inputs["audio_vae"], **req.component_options.get("audio_vae", {}))
        except ValueError as err:
            failures["audio_vae"] = err
    if failures:
        raise ConversionValidationError(failures)
    # the refiner stage's sampling settings go into model_index.json, where the pipeline reads them
    settings = refiner_settings(req.config) if "refiner" in prepared else {}

    # 2. Other components: each has its converter in diffusers_magi2.conversion.components.
    component_fns: dict[str, Callable] = {
        comp: getattr(components, fn_name) for comp, fn_name in COMPONENT_FUNCTIONS.items() if comp in req.components
    }

    if req.dry_run:
        for comp, prep in prepared.items():
            log(prep.describe())
            if req.dense_storage_dtype is not None:
                log(f"[{comp}] would store the dense projections in FP8 e4m3 with per-channel scales")
        for comp in component_fns:
            log(f"[{comp}] would convert {req.inputs[comp]} with components.{COMPONENT_FUNCTIONS[comp]}")
        if "scheduler" in req.components:
            log("[scheduler] would write UniPCMultistepScheduler (flow prediction, shift 7)")
        if req.sandai_code_dir is not None:
            log(f"[prompt_enhancer] would copy SandAI's templates from {req.sandai_code_dir}")
        if out.is_dir() and any(out.iterdir()):
            log(f"note: {out} exists and is not empty; a real run needs --overwrite")
        log("dry run: headers only (shard data not checked), nothing written")
        return None

    # 3. Write into a sibling temporary folder, then rename into place.
    token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = out.parent / f".{out.name}.tmp-{token}"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        written: dict[str, tuple[str, str]] = {}
        for comp, prep in prepared.items():
            log(f"[{comp}] writing {len(prep.plan.entries)} tensors into {len(prep.layouts)} shard(s)")
            write_transformer(prep, tmp / comp, log=log)
            if req.dense_storage_dtype is not None:
                store_dense_weights_fp8(tmp / comp, log=log)
            written[comp] = MODEL_INDEX_ENTRIES[comp]
        for comp, fn in component_fns.items():
            log(f"[{comp}] converting {req.inputs[comp]}")
            if comp == "text_encoder":
                fn(
                    req.inputs[comp],
                    tmp / "text_encoder",
                    tmp / "tokenizer",
                    req.dtype,
                    **req.component_options.get(comp, {}),
                )
                written["text_encoder"] = MODEL_INDEX_ENTRIES["text_encoder"]
                written["tokenizer"] = (MODEL_INDEX_ENTRIES["tokenizer"][0], _tokenizer_class(tmp / "tokenizer"))
            else:
                # the autoencoders run in fp32 (FP32_COMPONENTS): a bf16 file would only round them and make
                # loading copy every tensor to fp32
                dtype = "fp32" if comp in FP32_COMPONENTS else req.dtype
                fn(req.inputs[comp], tmp / comp, dtype, **req.component_options.get(comp, {}))
                written[comp] = MODEL_INDEX_ENTRIES[comp]
        if "scheduler" in req.components:
            default_scheduler().save_pretrained(tmp / "scheduler")
            written["scheduler"] = MODEL_INDEX_ENTRIES["scheduler"]
        if req.sandai_code_dir is not None:
            log(f"[prompt_enhancer] copying SandAI's templates and endpoint defaults from {req.sandai_code_dir}")
            written["prompt_enhancer"] = write_sandai_prompt_enhancer(tmp, req.sandai_code_dir)
        (tmp / "model_index.json").write_text(json.dumps(model_index_dict(written, settings), indent=2) + "\n")
        # the Modular Diffusers files: components named by the Hub id if given, else by subfolder
        write_modular_files(tmp, repo=req.repo_id)
        (tmp / "README.md").write_text(
            _render_card(
                req,
                [c for c in ALL_COMPONENTS + ("tokenizer", "prompt_enhancer") if c in written],
                prepared.get("transformer"),
            )
        )
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"wrote {out}")
    return out


def _render_card(req: ConversionRequest, components: list[str], transformer: PreparedTransformer | None) -> str:
    from .. import __version__

    repo_id = req.repo_id or "<your-namespace>/MAGI-2-preview-diffusers"
    count = None if transformer is None else sum(p.numel() for p in transformer.model.parameters())
    return render_model_card(
        {
            "title": "MAGI-2 Preview (Diffusers format)",
            "model_summary": model_summary(count),
            "repo_id": repo_id,
            "components_table": components_table(components),
            "converter_version": __version__,
            "dtype": req.dtype
            + (f", routed experts {req.expert_dtype}" if req.expert_dtype else "")
            + (
                f", dense projections {req.dense_storage_dtype} with per-channel scales"
                if req.dense_storage_dtype
                else ""
            ),
        }
    )


def _move_into_place(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{tmp.name.rsplit('-', 1)[-1]}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def push_folder_to_hub(
    folder: str | Path, repo_id: str, *, private: bool = False, log: Callable[[str], None] = print
) -> str:
    """Create (if needed) the Hub model repo ``repo_id`` and upload ``folder`` in one commit (``HfApi``).

    Returns:
        the repository URL.
    """
    from huggingface_hub import HfApi

    api = HfApi()
    url = api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
    api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        repo_type="model",
        commit_message="Upload MAGI-2 converted with diffusers_magi2 (magi2-convert)",
    )
    log(f"uploaded {folder} to {url}")
    return str(url)
