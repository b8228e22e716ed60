"""Raises on import, as a plugin with a missing vendor library or a syntax slip would."""

raise RuntimeError("polyspec-broken-backend is broken on purpose (test fixture)")
