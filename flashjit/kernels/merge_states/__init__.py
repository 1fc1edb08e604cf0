"""The merge_states family: MergeSpec, its argument struct, kernel object and KernelFamily (templates/merge_states/)."""
