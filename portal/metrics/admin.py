# Samples and rollups are machine data: the console shows them, the admin does not.
