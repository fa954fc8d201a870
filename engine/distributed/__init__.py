"""The tensor-parallel group, its collectives, peer access, the step ring and parent-death watching."""
