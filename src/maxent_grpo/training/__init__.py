"""The training shell: config, data, pipeline, loop, metrics, checkpoints."""
