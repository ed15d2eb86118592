"""Model families of the diffusion backend: one folder each, registered in `registry.FAMILY_MODULES`."""
