"""Decoding: the KV cache, draft trees, verification, the decode loop, measured costs and the shape policy.

Part of the core: it imports none of the plugin folders (`mmvsd/drafters/ mmvsd/data/ mmvsd/eval/ mmvsd/adapters/`);
see docs/architecture.md.
"""
