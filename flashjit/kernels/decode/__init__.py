"""The decode family: DecodeSpec, its tiling and argument structs, and its KernelFamily (templates/decode/)."""
