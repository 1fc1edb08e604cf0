"""The MLA family: MLASpec, its tiling and argument struct, and its KernelFamily (templates/mla/)."""
