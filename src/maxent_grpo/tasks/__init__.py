"""Tasks with several valid answers per prompt (ModeBench): verifiers, mode keys, data, reward."""
