"""MAGI-2 multi-head mixture of experts.

Notation: ``H`` MoE heads, ``S`` tokens, ``E`` experts per head, ``k`` top-k, ``Dh = C / H`` head width, ``De``
expert width, ``T = H S k`` routed rows, global expert id ``g = h E + e`` (SandAI's checkpoint order).
"""
