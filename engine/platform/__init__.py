"""What the engine needs to know of the machine it runs on: devices and dtypes, and host buffers for device copies."""
