"""Privacy core: accounting on Opacus and dp-accounting, client budgets, verdicts."""
