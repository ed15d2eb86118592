"""Execution backends for unitgraph plans, discovered through the `unitgraph.backends` entry-point group."""
