"""The split-KV work list every work-list family's kernels read (decode, MLA): its record ABI, the
numpy planner (the reference), the C host planner and shared-prefix detection.

A floor of its own: numpy and the C helper only, nothing of jit/, torch or serving/, so each
planner can be tested and compared byte for byte with the others on its own.
"""
