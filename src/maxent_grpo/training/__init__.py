"""The run, from its compiled plan (``maxent_grpo.config`` compiles it): setup, data, pipeline, loop,
metrics, checkpoints."""
