"""SandAI MAGI-2 checkpoint -> diffusers repository conversion (``magi2-convert``), the top layer.

``cli`` (the console script) -> ``repo`` (the whole repository) -> ``convert_transformer`` (streamed transformer
shards), ``components`` / ``components_text`` (VAEs, audio VAE, text encoder), ``model_card``.
"""
