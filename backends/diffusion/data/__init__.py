"""Data: DiffSynth-style datasets (metadata beside image and video files), the image and clip readers,
and stage 2's batching (seeded order, shape buckets, collation)."""
