"""Every byte count the engine and the GUI's capacity planner share; torch-free."""
