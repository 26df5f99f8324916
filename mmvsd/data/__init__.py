"""Training and benchmark data: conversation readers, rendering, on-policy regeneration, synthetic images,
MT-Bench and GSM8K files."""
