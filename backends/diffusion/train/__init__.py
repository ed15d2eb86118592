"""Stage 2 and the unsplit run: the training loop, the executor that feeds it from the cache, resume
states, validation samples, LoRA checkpoints and the run's output folder."""
