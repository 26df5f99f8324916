"""Training drafters: configuration, data plumbing and media, target features, objectives (CE, VSD and its E-step),
initialisation from released drafters, the trainer and its on-policy regeneration.

Sits above the core, `mmvsd/drafters/`, `mmvsd/data/` and `mmvsd/adapters/`; see docs/architecture.md.
"""
