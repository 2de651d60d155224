"""The admin API: load and unload models, the die and instance tables, the live feed."""
