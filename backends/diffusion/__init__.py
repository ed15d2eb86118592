"""Diffusion backend."""
