"""The diffusion backend: executes unitgraph plans for diffusion models (stage 1 fills a cache, stage 2 trains from it).

CONTRIBUTING.md maps its rooms (models/, data/, cache/, train/) and its families (families/).
"""
