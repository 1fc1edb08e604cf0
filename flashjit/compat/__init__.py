"""Drop-in modules with other libraries' APIs over flashjit's kernels."""
