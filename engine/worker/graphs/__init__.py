"""CUDA graphs: whole-forward decode graphs, piecewise graphs, and which one a step takes."""
