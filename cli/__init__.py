"""unitgraph command line."""
