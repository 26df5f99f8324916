"""Checkpoint layouts: the interface of a released or export format, the registry that detects one, and export.

Part of the core; the layouts themselves live beside their drafters (`mmvsd/drafters/*_layout.py`).
"""
