#!/usr/bin/env python
"""MAGI-2 main job: prompt (and optional image) -> mp4 with sound (10 s with the released model).

Without ``--model`` it runs the embedded tiny default (``build_tiny_default_pipeline``: the tiny model trained on
the synthetic world of ``diffusers_magi2.pipelines.tiny_world`` and shipped in the package, offline; a 2 s clip at
its ``tiny_call_defaults`` resolution and step count), which runs the whole chain on any machine and draws what a
world caption asks. With ``--model`` it loads a converted diffusers repo (local folder or Hub id)::

    python examples/generate.py --prompt "a red circle moves right" --output circle.mp4
    python examples/generate.py --model ./magi2-preview-diffusers --prompt "..." \
        --height 512 --width 896 --num_inference_steps 100 --output clip.mp4
    # 1080p: preview at 512x896, then the refiner stage (a repo converted with the refiner), 25 fps
    python examples/generate.py --model ./magi2-preview-diffusers --prompt "..." --resolution 1080p \
        --output_height 1080 --output_width 1920 --output clip_1080p.mp4
    # prompt enhancement through an OpenAI-compatible server; the enhanced prompt is printed and kept in clip.prompt.md
    python examples/generate.py --model ./magi2-preview-diffusers --prompt "a fox in the snow" --enhance_prompt \
        --pe_base_url http://127.0.0.1:8000/v1 --pe_model Qwen/Qwen3-32B --output clip.mp4

Structure: argparse -> build/load the pipeline -> call -> export on rank 0. The wall time (script
start to file written, imports included) is printed at the end.
"""

from __future__ import annotations

import time


_START = time.perf_counter()


def _seconds_since_process_start() -> float:
    """Wall seconds since this script started executing (``_START`` is taken before any heavy import, so the
    torch/diffusers imports count). ``/proc/self/stat`` is not used: a shell that ``exec``s python as the last
    command of a chain would carry the shell's start time over and count the install steps too."""
    return time.perf_counter() - _START


import argparse  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402


class _OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``error: ...`` line on stderr (rank 0 only) and exit status 2."""

    def error(self, message: str):
        report_error(f"{message} (see --help)")
        sys.exit(2)


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _multiple_of_16(text: str) -> int:
    """argparse type: a positive multiple of 16 (the VAE's 16x spatial stride)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1 or value % 16:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 16 (e.g. 256, 448, 512, 896), got {text!r}")
    return value


def _finite_nonnegative(text: str) -> float:
    """argparse type: a finite float >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not (0.0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (1 disables guidance), got {text!r}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check the arguments; every check here needs neither torch nor a model.

    Raises:
        SystemExit(2): after one ``error: ...`` line, for a value argparse's types refuse.
        ValueError: for a combination, path or output that cannot work (:func:`check_args`).
    """
    parser = _OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", required=True, help="text prompt, or a JSON prompt with a global_layer")
    parser.add_argument("--negative_prompt", default=None, help="default: the model's built-in negative prompt")
    parser.add_argument("--image", default=None, help="reference image file (or http(s) URL) for image-to-video")
    parser.add_argument(
        "--model", default=None, help="converted diffusers repo (folder or Hub id org/name); default: tiny"
    )
    parser.add_argument(
        "--num_inference_steps", type=_positive_int, default=None, help="default: 100, or the tiny default's"
    )
    parser.add_argument(
        "--height", type=_multiple_of_16, default=None, help="pixels, multiple of 16 (default 512, tiny: its own)"
    )
    parser.add_argument(
        "--width", type=_multiple_of_16, default=None, help="pixels, multiple of 16 (default 896, tiny: its own)"
    )
    parser.add_argument(
        "--resolution",
        choices=["272p", "540p", "1080p"],
        default=None,
        help="preset instead of --height/--width: 272p = 256x448, 540p = 512x896, 1080p = 1088x1920 "
        "(preview 512x896, then the refiner stage; needs a repo with the refiner; 25 fps)",
    )
    parser.add_argument(
        "--output_height",
        type=_positive_int,
        default=None,
        help="optional bilinear resize of the decoded frames (with --output_width, e.g. 1080)",
    )
    parser.add_argument("--output_width", type=_positive_int, default=None, help="see --output_height (e.g. 1920)")
    parser.add_argument(
        "--guidance_scale", type=_finite_nonnegative, default=5.0, help="video CFG scale (default 5.0)"
    )
    parser.add_argument(
        "--audio_guidance_scale", type=_finite_nonnegative, default=7.0, help="audio CFG scale (default 7.0)"
    )
    parser.add_argument("--seed", type=int, default=42, help="seed of the noise generator (default 42)")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="compute dtype of the models (unset: with --model, bfloat16 on CUDA and float32 on "
        "CPU; the tiny default: float32); fp32 islands, the Wan2.2 VAE and the Oobleck decoder "
        "stay float32",
    )
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--output", required=True, help="output .mp4 path")
    parser.add_argument(
        "--ep_degree",
        type=_positive_int,
        default=None,
        help="expert-parallel ranks (default: the world size under accelerate launch/torchrun, "
        "else 1); must divide the number of launched processes (replicas of EP groups)",
    )
    parser.add_argument(
        "--ulysses_degree",
        type=_positive_int,
        default=None,
        help="context-parallel (Ulysses) ranks of both transformers (default: the world size under "
        "accelerate launch/torchrun, else 1); must equal the number of launched processes",
    )
    parser.add_argument(
        "--vram_gb",
        type=_positive_int,
        default=None,
        help="stream the text encoder's layers and both transformers' blocks from host memory through a small ring "
        "on the GPU, for a card of this many GB (e.g. 24 or 32), one model's weights held at a time when loaded from "
        "files (under expert parallelism each rank's transformer stays held); the other components stay resident "
        "(Magi2Pipeline.enable_weight_streaming)",
    )
    parser.add_argument(
        "--host_memory",
        choices=["pinned", "disk"],
        default=None,
        help="with --vram_gb: where the streamed weights live (default pinned: held once in page-locked host "
        "memory; disk: read from --model's safetensors files through a staging ring of a few blocks)",
    )
    pe = parser.add_argument_group("prompt enhancement (an OpenAI-compatible chat-completions endpoint)")
    pe.add_argument(
        "--enhance_prompt",
        action="store_true",
        help="rewrite --prompt into MAGI-2's structured caption first; print it and save it beside the clip as "
        "<output without .mp4>.prompt.md (with a remote endpoint the prompt and the image leave this machine)",
    )
    pe.add_argument(
        "--pe_base_url", default=None, help="the endpoint, e.g. http://127.0.0.1:8000/v1 (default: $OPENAI_BASE_URL)"
    )
    pe.add_argument(
        "--pe_model", default=None, help="the model name the endpoint serves (needed with --enhance_prompt)"
    )
    pe.add_argument("--pe_api_key", default=None, help="the endpoint's key (default: $OPENAI_API_KEY, else none)")
    args = parser.parse_args(argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """Reject argument combinations and paths that cannot work, before torch is imported.

    Allowed: ``--resolution`` or ``--height``/``--width``, not both; ``--output_height`` with ``--output_width``;
    ``--model`` an existing folder holding ``model_index.json`` (a ``magi2-convert`` output) or a Hub id
    ``org/name``; ``--image`` an existing image file or an http(s) URL; ``--output`` see :func:`check_output_path`.
    ``--host_memory`` only with ``--vram_gb``; ``disk`` only with ``--model`` (it reads that repo's files).

    Raises:
        ValueError: naming the argument, what was wrong and what is allowed.
    """
    if args.resolution is not None and (args.height is not None or args.width is not None):
        raise ValueError("pass either --resolution or --height/--width, not both")
    if (args.output_height is None) != (args.output_width is None):
        raise ValueError("--output_height and --output_width go together (a bilinear resize of the decoded frames)")
    if args.model is not None:
        check_model_path(args.model)
    if args.image is not None:
        check_image_path(args.image)
    check_output_path(args.output)
    check_launch_degrees(args.ep_degree, args.ulysses_degree)
    if args.host_memory is not None and args.vram_gb is None:
        raise ValueError("--host_memory goes with --vram_gb (it says where the streamed weights live)")
    if args.host_memory == "disk" and args.model is None:
        raise ValueError(
            "--host_memory disk reads the streamed weights from the safetensors files of --model; pass --model (a "
            "magi2-convert folder or a Hub id), or use --host_memory pinned (the default)"
        )
    check_prompt_enhancement_flags(args)


def check_prompt_enhancement_flags(args: argparse.Namespace) -> None:
    """``--pe_*`` only with ``--enhance_prompt``, which needs ``--pe_model``.

    Raises:
        ValueError: naming the flag.
    """
    given = [f"--{name}" for name in ("pe_base_url", "pe_model", "pe_api_key") if getattr(args, name) is not None]
    if given and not args.enhance_prompt:
        raise ValueError(f"{', '.join(given)} configure --enhance_prompt; pass --enhance_prompt too, or drop them")
    if args.enhance_prompt and not args.pe_model:
        raise ValueError("--enhance_prompt needs --pe_model, the name of the model the endpoint serves")


def enhanced_prompt_path(output: str) -> str:
    """Where ``--enhance_prompt`` keeps the enhanced prompt: beside the clip, ``clip.mp4`` -> ``clip.prompt.md``."""
    return os.path.splitext(output)[0] + ".prompt.md"


def enhance_and_save_prompt(pipe, args: argparse.Namespace) -> str:
    """``--enhance_prompt``: the prompt rewritten by the endpoint (``pipe.enhance_prompt``, every rank together: rank
    0 asks, all get its text); rank 0 prints it and writes it to :func:`enhanced_prompt_path` (a temporary file
    renamed into place), before any generation, so it can be reused and edited as ``--prompt``.

    Raises:
        ValueError: the endpoint's error (unreachable, timeout, HTTP error, a reply that is not the schema's JSON),
            naming it.
    """
    from diffusers_magi2 import Magi2PromptEnhancer

    pipe.prompt_enhancer = Magi2PromptEnhancer.from_endpoint(
        base_url=args.pe_base_url, model=args.pe_model, api_key=args.pe_api_key
    )
    try:
        prompt = pipe.enhance_prompt(args.prompt, image=args.image)
    except RuntimeError as err:  # the endpoint's failure is a bad setting of this run: one error line, exit 2
        raise ValueError(f"--enhance_prompt: {err}") from err
    if int(os.environ.get("RANK", "0")) == 0:
        path = enhanced_prompt_path(args.output)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as file:
            file.write(prompt)
        os.replace(tmp, path)
        print(f"enhanced prompt (saved to {path}):\n{prompt}")
    return prompt


def check_launch_degrees(ep_degree, ulysses_degree) -> None:
    """The launch rules (``launch_rules.launch_degrees``) applied to the launcher's ``WORLD_SIZE`` before torch is
    imported, so a wrong launch fails in well under a second; they run again on the process group's size once it
    exists (``expert_parallel_from_launch`` / ``context_parallel_from_launch``).

    Raises:
        ValueError: ``ep_degree`` does not divide the world size or the CP degree; ``ulysses_degree`` differs
            from the world size.
    """
    launch_rules().launch_degrees(ep_degree, ulysses_degree)


def launch_rules():
    """``examples/launch_rules.py`` (beside this script, on ``sys.path`` since this module's import)."""
    import launch_rules as rules

    return rules


EXAMPLES = os.path.dirname(os.path.abspath(__file__))
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
if EXAMPLES not in sys.path:  # the modules beside this script, also when it is loaded by path
    sys.path.insert(0, EXAMPLES)
from generate_streaming import (  # noqa: E402
    repo_streamed_stages,
    streaming_summary,
    tile_streamed_refined_decode,
)


def check_model_path(model: str) -> None:
    """``--model``: an existing converted repo folder, or something shaped like a Hub id (``org/name``).

    Raises:
        ValueError: a folder without ``model_index.json``, a file, or a path that does not exist and is no Hub id.
    """
    from pathlib import Path

    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "model_index.json").is_file():
            raise ValueError(
                f"--model {model!r} is a folder without model_index.json, not a converted diffusers repo; "
                "convert a SandAI release first: magi2-convert --checkpoint_root RELEASE --output_path OUT"
            )
        return
    if path.exists():
        raise ValueError(f"--model {model!r} is a file; pass the converted repo's folder (it holds model_index.json)")
    if model.startswith((".", "/", "~")) or not _HUB_ID.match(model):
        raise ValueError(
            f"--model {model!r}: no such folder, and not a Hub id (org/name); pass a magi2-convert output folder"
        )


def check_image_path(image: str) -> None:
    """``--image``: an http(s) URL (fetched later) or an existing file that PIL can open as an image.

    Raises:
        ValueError: the file does not exist, is a folder, or is not an image.
    """
    if image.startswith(("http://", "https://")):
        return
    from pathlib import Path

    path = Path(image).expanduser()
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ValueError(f"--image {image!r} {what}; pass an image file (png, jpg, ...) or an http(s) URL")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img.verify()
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"--image {image!r} is not an image file PIL can read ({err})") from None


#: seconds a rank other than 0 waits after an error before it exits: rank 0, refusing the same input, prints its line
#: and ends the launch meanwhile (a launcher stops every rank once one exits, rank 0 too if it has not printed yet)
OTHER_RANK_EXIT_DELAY_S = 5.0


def report_error(message) -> None:
    """Print ``error: <message>`` as one line on stderr from rank 0 only (``RANK`` unset counts as rank 0); another
    rank prints nothing and waits :data:`OTHER_RANK_EXIT_DELAY_S`, so that its exit cannot stop rank 0 first."""
    if os.environ.get("RANK", "0") == "0":
        print("error: " + " ".join(str(message).split()), file=sys.stderr, flush=True)
    else:
        time.sleep(OTHER_RANK_EXIT_DELAY_S)


def check_device(device: str) -> None:
    """Reject a ``--device`` this machine does not have, before any model is built or run.

    Allowed: ``cpu``, or an accelerator torch can use here (``cuda``/``cuda:N`` with N below the device count;
    another type, e.g. ``mps`` or ``xpu``, when it is ``torch.accelerator``'s current accelerator).

    Raises:
        ValueError: not a torch device string, or a device this machine does not have.
    """
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"--device {device!r} is not a torch device; use cpu, cuda or cuda:N ({err})") from err
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(
                f"--device {device!r}: no CUDA device is available (torch {torch.__version__}, {build}); "
                "use --device cpu, or leave --device out to pick cuda when present"
            )
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"--device {device!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
        return
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type != dev.type:
        raise ValueError(f"--device {device!r}: torch reports no {dev.type} device on this machine; use --device cpu")


def check_output_path(output: str) -> None:
    """Reject an ``--output`` that cannot be written, before any model is built or run.

    Allowed: a path ending in ``.mp4`` (any case) that is not an existing directory, whose parent folder exists
    or can be created. The writer (rank 0; every rank when not launched) proves it by creating the missing
    folders and a temporary file beside the output, as the export will; it then removes both, so a later error
    leaves nothing behind. Permission bits alone do not tell (root passes ``os.access`` on a read-only or
    virtual file system).

    Raises:
        ValueError: wrong suffix, an existing directory, or a folder where no file can be created.
    """
    from pathlib import Path

    path = Path(output).expanduser()
    if path.suffix.lower() != ".mp4":
        raise ValueError(f"--output must be an .mp4 file path (e.g. clip.mp4); got {output!r}")
    if path.is_dir():
        raise ValueError(f"--output {output!r} is an existing directory; pass a file path ending in .mp4")
    if os.environ.get("RANK", "0") != "0":  # only rank 0 writes (on its own machine)
        return
    ancestor = path.parent.resolve()
    missing = []
    while not ancestor.exists():
        missing.append(ancestor)
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(
            f"--output {output!r}: its parent folder cannot be created ({str(ancestor)!r} is a file, not a folder)"
        )
    created, inside = [], ancestor  # inside: the folder the next file or folder is created in
    try:
        for folder in reversed(missing):
            folder.mkdir()
            created.append(folder)
            inside = folder
        import tempfile

        handle, probe = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".probe", dir=inside)
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(
            f"--output {output!r}: cannot create a file in {str(inside)!r} ({err.strerror or err}); pass a path in "
            "a folder this process can write"
        ) from None
    finally:
        for folder in reversed(created):
            folder.rmdir()


def pretrained_dtype(dtype_name: str):
    """``dtype=`` for ``Magi2Pipeline.from_pretrained``: ``dtype_name`` for every component except the
    Wan2.2 VAE and the Oobleck decoder, which stay fp32 (the reference's split); a per-component dict,
    as diffusers 0.42.1 accepts."""
    import torch

    from diffusers_magi2.utils.dtype_utils import parse_dtype

    dtype = parse_dtype(dtype_name, "--dtype")
    if dtype == torch.float32:
        return dtype
    return {"default": dtype, "vae": torch.float32, "audio_vae": torch.float32}


def end_distributed_run(exit_code: int = 0) -> None:
    """:func:`launch_rules.end_distributed_run` (barrier, destroy the group, ``os._exit`` on CPU)."""
    launch_rules().end_distributed_run(exit_code)


def load_pipeline(args):
    """The tiny default (no ``--model``) or a converted repo; returns ``(pipe, call_defaults)`` and sets
    ``args.expert_parallel``, ``args.context_parallel`` and ``args.planned_stages`` (with ``--vram_gb``, the memory
    plan's checked stages of the call; ``None`` where the plan does not apply, another model or a launched parallel
    run, or without ``--vram_gb``)."""
    from diffusers_magi2 import Magi2Pipeline
    from diffusers_magi2.parallel.expert_parallel import ep_device
    from diffusers_magi2.pipelines.tiny_default import build_tiny_default_pipeline
    from diffusers_magi2.utils.dtype_utils import parse_dtype

    rules = launch_rules()

    # EP: one process per rank (accelerate launch --multi_gpu / torchrun); an --ep_degree that does not match the
    # launched world size raises (e.g. `accelerate launch --cpu` starts one process).
    rules.init_distributed_from_launch()
    expert_parallel = rules.expert_parallel_from_launch(args.ep_degree)
    context_parallel = rules.context_parallel_from_launch(args.ulysses_degree, args.ep_degree)
    args.expert_parallel = expert_parallel
    args.context_parallel = context_parallel
    device = args.device or str(ep_device(expert_parallel))
    single_card = expert_parallel is None and context_parallel is None  # what the memory plan describes
    if args.model is None:  # not the released geometry: no planned stages
        stages = None
        pipe = build_tiny_default_pipeline(dtype=parse_dtype(args.dtype or "float32"))
        defaults = dict(pipe.tiny_call_defaults)
        if expert_parallel is not None:
            pipe.transformer.enable_expert_parallel(expert_parallel)
        if context_parallel is not None:
            pipe.enable_context_parallel(context_parallel)
    else:
        defaults = {"height": 512, "width": 896, "num_inference_steps": 100}
        streamed = args.vram_gb is not None and single_card
        stages = repo_streamed_stages(args, *call_size(args, defaults)) if streamed else None
        dtype_name = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
        pipe = Magi2Pipeline.from_pretrained(
            args.model,
            dtype=pretrained_dtype(dtype_name),
            expert_parallel=expert_parallel,
            context_parallel=context_parallel,
        )
    args.planned_stages = stages
    if args.vram_gb is not None:
        from diffusers_magi2.pipelines.weight_streaming_pipeline import STREAMED_RING_SIZE

        host_memory = args.host_memory or "pinned"
        pipe.enable_weight_streaming(  # the released model on one card streams as the recipes plan it
            vram_gb=args.vram_gb,
            host_memory=host_memory,
            device=device,
            ring_size=STREAMED_RING_SIZE,
            release_between_stages=True if stages is not None else None,
        )
        if os.environ.get("RANK", "0") == "0":
            ep_degree = expert_parallel.ep_degree if expert_parallel is not None else 1
            ulysses_degree = context_parallel.ulysses_degree if context_parallel is not None else 1
            line = streaming_summary(args.vram_gb, host_memory, STREAMED_RING_SIZE, stages, ep_degree, ulysses_degree)
            print(line, flush=True)
    else:
        pipe.to(device)
    return pipe, defaults


def call_size(args, defaults: dict) -> tuple:
    """The output ``(height, width)``: ``--resolution``'s preset, else ``--height``/``--width`` or the defaults."""
    if args.resolution is not None:
        from diffusers_magi2.pipelines.pipeline_magi2 import RESOLUTION_PRESETS

        return RESOLUTION_PRESETS[args.resolution]
    return (
        args.height if args.height is not None else defaults["height"],
        args.width if args.width is not None else defaults["width"],
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from diffusers_magi2 import export_to_video_with_audio
    from diffusers_magi2.utils.export import probe_streams

    if args.device is not None:
        check_device(args.device)
    pipe, defaults = load_pipeline(args)
    height, width = call_size(args, defaults)
    steps = args.num_inference_steps if args.num_inference_steps is not None else defaults["num_inference_steps"]
    tile_streamed_refined_decode(pipe, args, height, width)
    generator = torch.Generator("cpu").manual_seed(args.seed)
    prompt = enhance_and_save_prompt(pipe, args) if args.enhance_prompt else args.prompt

    output = pipe(
        prompt=prompt,
        negative_prompt=args.negative_prompt,
        image=args.image,
        height=height,
        width=width,
        num_inference_steps=steps,
        guidance_scale=args.guidance_scale,
        audio_guidance_scale=args.audio_guidance_scale,
        generator=generator,
        output_type="np",
        output_height=args.output_height,
        output_width=args.output_width,
    )

    if int(os.environ.get("RANK", "0")) == 0:
        # A clip of duration_s != 10 has 4(T - 1) + 1 frames, which can end more than a frame before its audio
        # (5 s: 61 frames = 4.88 s at 12.5 fps); SandAI muxes both streams as they are. Here the audio is cut
        # (or padded) to the video's duration, so both streams end together (10 s clips are unchanged).
        path = export_to_video_with_audio(
            output.frames[0],
            args.output,
            audio=output.audio[0],
            fps=output.fps,
            audio_sample_rate=output.audio_sample_rate,
            trim_or_pad_audio=True,
        )
        info = probe_streams(path)
        print(
            f"wrote {path}: {info['video_frames']} frames {output.frames.shape[2]}x{output.frames.shape[3]} at "
            f"{float(info['fps'])} fps "
            f"({info['video_duration_s']:.2f} s), audio {info.get('audio_sample_rate')} Hz x "
            f"{info.get('audio_channels')} ch ({info.get('audio_stream_duration_s', 0.0):.2f} s), "
            f"{steps} step{'' if steps == 1 else 's'}, "
            f"model {'tiny default (trained on the tiny world)' if args.model is None else args.model}"
        )
        if args.expert_parallel is not None:
            print(f"expert parallel: routed experts split over {args.expert_parallel.ep_degree} ranks")
        if args.context_parallel is not None:
            print(
                f"context parallel: packed sequence split over {args.context_parallel.ulysses_degree} ranks (Ulysses)"
            )
        print(
            f"main job wall time: {_seconds_since_process_start():.1f} s (script start to mp4 written, imports included)"
        )
    return 0


def abort_distributed_run() -> None:
    """After an error: destroy the process group without a barrier (the other ranks may never reach one)."""
    if "torch.distributed" not in sys.modules:  # failed before torch was imported: nothing to tear down
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run(argv=None) -> int:
    """``main`` as a command: bad input (``ValueError``, or an ``OSError`` such as a missing file or Hub repo) is one
    ``error: ...`` line on stderr from rank 0 and exit status 2; any other exception keeps its traceback."""
    try:
        rc = main(argv)
    except (ValueError, OSError) as err:
        abort_distributed_run()
        report_error(err)
        return 2
    except BaseException:
        abort_distributed_run()
        raise
    end_distributed_run(rc)  # distributed: barrier, destroy the group, os._exit on CPU (gloo teardown abort)
    return rc


if __name__ == "__main__":
    sys.exit(run())
