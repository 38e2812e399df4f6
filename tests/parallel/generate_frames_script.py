"""``examples/generate.py`` (its ``run``, with this script's arguments) keeping the frames it encodes: each export it
makes first saves the uint8 frames handed to the encoder (``frames_to_uint8`` of the pipeline's frames) beside the
mp4, as ``<output stem>.npy``; under ``accelerate launch`` rank 0 alone exports. Run by
``test_ep_accelerate_launch.py`` (whose single-process run wraps the export with :func:`keeping_frames` in its own
process) and ``test_two_machine_launch.py``."""

import importlib.util
import sys
from pathlib import Path

import numpy as np

import diffusers_magi2
from diffusers_magi2.utils.export import frames_to_uint8


def keeping_frames(export):
    """``export`` (``export_to_video_with_audio``) that first saves its frames, as uint8, to ``<output stem>.npy``."""

    def export_and_keep(video, output_path, *args, **kwargs):
        np.save(Path(output_path).with_suffix(".npy"), frames_to_uint8(video))
        return export(video, output_path, *args, **kwargs)

    return export_and_keep


if __name__ == "__main__":
    # the example script itself, not a copy of it
    _spec = importlib.util.spec_from_file_location(
        "magi2_generate", Path(__file__).parents[2] / "examples" / "generate.py"
    )
    _generate = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_generate)
    diffusers_magi2.export_to_video_with_audio = keeping_frames(diffusers_magi2.export_to_video_with_audio)
    sys.exit(_generate.run(sys.argv[1:]))
