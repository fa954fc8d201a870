"""The Qt application: windows, engine supervisor, API/stats clients, NVML sampler, settings."""
