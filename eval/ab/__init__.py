"""A/B of combine dtypes: one server per dtype, the GSM8K driver against each, one markdown table."""
