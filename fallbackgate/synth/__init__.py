"""Random-weight checkpoints with published MoE shapes: memory, bandwidth and overhead are real, quality is not."""
