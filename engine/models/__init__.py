"""Model implementations: one decoder with the per-architecture differences as configuration."""
