"""The service's foundations: settings, logs, errors and problems, budgets, metrics."""
