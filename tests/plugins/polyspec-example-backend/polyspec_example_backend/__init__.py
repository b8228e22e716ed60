"""Example polyspec backend plugin (backend name ``example``)."""
