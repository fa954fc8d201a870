"""Model families: the registry (HF architecture -> family module) and one file per family."""
