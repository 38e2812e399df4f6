"""MAGI-2 multi-head mixture of experts.

Notation used throughout this subpackage:

* ``H`` MoE heads (12 released), ``S`` tokens, ``E`` experts per head (256 released),
  ``k`` top-k (6 released), ``Dh`` MoE head width = hidden / H (256 released; not the attention
  head dim), ``De`` expert width (1280 released), ``T = H * S * k`` routed rows.
* Flattened (global) expert id ``g = head * E + e`` (head-major), as in SandAI's checkpoint.
"""
