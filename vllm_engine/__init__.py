"""How this project builds and drives one vLLM engine (shared by both worker roles).

Kept import-light: `torchvision_shim` is loaded at every interpreter start.
"""
