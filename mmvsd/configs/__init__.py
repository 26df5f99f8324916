"""Shipped training configs (YAML) and the accelerate / DeepSpeed launch files, read by name
(`--config smollm2_cpu`)."""
