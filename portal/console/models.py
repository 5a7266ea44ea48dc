# The console reads other apps' models (metrics, billing, nodes, jobs); it has none of its own.
