"""Convert SandAI's MAGI-2 Preview checkpoint into a Hub-loadable diffusers repository.

Thin wrapper: the converter lives in ``diffusers_magi2.conversion`` (``convert_transformer``,
``repo``, ``cli``; the key plan in ``diffusers_magi2.loaders.key_plan``) and is also installed as the
``magi2-convert`` console script. Run ``python conversion/convert_magi2_to_diffusers.py --help``.

What is not a plain rename (see ``diffusers_magi2/loaders/key_plan.py``): ``router.expert_bias``
takes the values of ``router.expert_bias_ema``; nothing else is transformed.

Dry run on the released layout (headers only, nothing written)::

    python conversion/convert_magi2_to_diffusers.py --checkpoint_root /ckpt --output_path out --dry_run
"""

import sys

from diffusers_magi2.conversion.cli import main


if __name__ == "__main__":
    sys.exit(main())
