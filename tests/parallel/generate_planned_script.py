"""``examples/generate.py`` (its ``run``, with this script's arguments) with the memory plan applying to ``--model``:
``repo_streamed_stages`` returns the stages of a 540p call decoded by the TurboVAE, as for the released model (the
tiny pipeline a test saves is not its geometry). Run under ``accelerate launch`` by
``test_generate_streaming_launch.py``."""

import importlib.util
import sys
from pathlib import Path


STAGES = ["text_encode", "preview_540p", "turbovae_decode_540p", "audio_decode"]


if __name__ == "__main__":
    # the example script itself, not a copy of it
    _spec = importlib.util.spec_from_file_location(
        "magi2_generate", Path(__file__).parents[2] / "examples" / "generate.py"
    )
    _generate = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_generate)
    _generate.repo_streamed_stages = lambda *args: list(STAGES)
    sys.exit(_generate.run(sys.argv[1:]))
