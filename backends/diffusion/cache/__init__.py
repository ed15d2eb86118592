"""The stage-1 cache: entries and their keys, the manifest, the cache folder with its journals and
shards, and the stores it lives on (a local folder or an S3-compatible bucket)."""
