"""Decoding: the KV cache, draft trees, verification, the decode loop, measured costs and the shape policy.

Part of the core: it imports no top-level folder (`drafters/ data/ eval/ adapters/`); see docs/architecture.md.
"""
