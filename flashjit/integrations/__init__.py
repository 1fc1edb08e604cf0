"""flashjit inside serving frameworks (optional extras)."""
