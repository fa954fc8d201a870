"""What the engine core drives: one model runner, or rank 0 of a tensor-parallel group and its workers."""
