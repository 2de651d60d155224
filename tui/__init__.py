"""The ``pantheon tui`` dashboard: a Textual client of the router's admin API."""
