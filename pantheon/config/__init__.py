"""The serve configuration: one settings table, and the typed, frozen object built from flags, environment and the TOML file."""
