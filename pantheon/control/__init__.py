"""The control plane: the registry, loads and unloads, recovery, dies and their budgets, memory pressure, context fitting, the live feed, registration with a router registry."""
