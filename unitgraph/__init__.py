"""unitgraph core."""
