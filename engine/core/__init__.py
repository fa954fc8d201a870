"""The engine's host side: requests, the scheduler's step loop, sequences, outputs and their processing."""
