"""Privacy auditing: the canaries of a one-run audit and the lower bound on epsilon it
gives (Steinke, Nasr & Jagielski, NeurIPS 2023)."""
