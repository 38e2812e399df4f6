"""SandAI MAGI-2 checkpoint -> diffusers repository conversion (``magi2-convert``), the top layer.

Modules (imported on demand; ``import diffusers_magi2.conversion`` stays cheap):

* ``convert_transformer``: the loader's validated key plan (:mod:`diffusers_magi2.loaders`) -> output
  shard layout -> streamed shards (:mod:`diffusers_magi2.utils.safetensors_io`).
* ``repo``: the whole repository (``model_index.json``, scheduler, model card, temp dir + rename).
* ``cli``: the ``magi2-convert`` console script; ``model_card``: renders the top-level
  ``model_card.md``.
* ``components`` / ``components_text``: Wan2.2 VAE, TurboVAE, Stable Audio and text encoder.
"""
