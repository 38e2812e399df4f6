"""SandAI MAGI-2 checkpoint -> diffusers repository conversion (``magi2-convert``).

Modules (imported on demand; ``import diffusers_magi2.conversion`` stays cheap):

* ``safetensors_io``: our safetensors header parser (works on header-only / sparse stubs) and
  the streaming, pre-sized shard writer.
* ``key_plan``: SandAI key -> diffusers key (``block.layers.{i}.`` -> ``transformer_blocks.{i}.``,
  ``expert_bias`` := ``expert_bias_ema``), output dtypes, and exhaustive validation.
* ``convert_transformer``: config -> meta model -> validated plan -> streamed shards, and the
  in-memory loader behind ``from_original_checkpoint``.
* ``repo``: the whole repository (``model_index.json``, scheduler, model card, temp dir + rename).
* ``cli``: the ``magi2-convert`` console script; ``model_card``: renders the top-level
  ``model_card.md``.
* ``sandai_config`` / ``sandai_config_refiner``: SandAI JSON configs -> model kwargs.
* ``components`` / ``components_text``: Wan2.2 VAE, TurboVAE, Stable Audio and text encoder.
"""
