"""Models: where a family's components are found (local folders, DiffSynth's layout, the hub), how they
load, LoRA adapters on them, and the offline tokenizers of the tiny models."""
