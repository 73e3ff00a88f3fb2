"""Integrations with other libraries, each in its own module. Each registers neutral hooks with the core
(`cbopt.optimizer.on_create`, `cbopt.optimizer.load_policies`) and imports its library only if the user has."""
