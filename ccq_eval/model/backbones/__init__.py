"""The linear-attention backbones CCQ attaches to, one module each (`seam` holds what they plug into).

Each module defines its family's `Backbone` (where r, the keys and the decay come from, which kernels read)
and its CCQ layer class (fla's layer reading with q~).
"""
