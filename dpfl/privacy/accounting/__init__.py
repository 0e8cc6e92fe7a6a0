"""Privacy accounting: events and their curves (one type per mechanism), the accountants
and calibration, budgets and the Rényi filter, the ledger, the record's codec and the
participation schemas of correlated noise."""
