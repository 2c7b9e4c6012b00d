"""fxopt (public API assembled once all modules land)."""
