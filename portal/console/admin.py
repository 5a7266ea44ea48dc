# The console has no models of its own.
