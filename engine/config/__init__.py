"""Engine and model configuration read from flags and config.json files; torch-free (the app imports it)."""
